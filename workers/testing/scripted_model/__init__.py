"""A scripted, strict stand-in for the Anthropic Messages API (``POST /v1/messages``, non-streaming).

Tests and the offline demo point ``ANTHROPIC_BASE_URL`` at a :class:`ScriptedModel`; the real
``anthropic`` SDK then talks to it over HTTP exactly as it would to the API (the SDK uses its own HTTP
stack, so nothing can be monkeypatched or intercepted in-process). Requests are validated the way the
API validates them, so code that only works against this server because it is lenient is a bug we
want to see here, not in production.

Script format
-------------
``scripts`` maps a script name to a list of *steps*. A request picks its script with a marker
``[script:NAME]`` anywhere in the text of its first user message (no marker: the script ``"default"``
if given, else a built-in one that answers ``end_turn`` with "Done."). The step used is the number of
assistant messages already in ``messages``, so selection is stateless: a call retried after a crash
gets the same step again. Past the end of the list the answer is ``end_turn`` with text "Done.".

Every key of a step is optional::

    {
      "research": [
        {"thinking": "I should search first.",          # thinking block (signed), first
         "text": "Let me look that up.",                 # text block
         "tool_calls": [{"name": "search", "input": {"q": "rq"}},
                        {"name": "fetch", "input": {"url": "https://python-rq.org"}}],
         "delay": 0.2},                                  # seconds to wait before answering
        {"error": {"status": 529, "type": "overloaded_error", "message": "Overloaded",
                   "times": 2, "retry_after": 1},        # first 2 requests at this step fail
         "text": "RQ is a job queue."},                  # ...then this is the answer
        {"text": "truncated", "stop_reason": "max_tokens",
         "usage": {"output_tokens": 4096}}               # override computed usage numbers
      ]
    }

A step may instead hold ``branches``, chosen by ``when`` conditions on the last tool results
(``is_error``, ``result_contains``, ``result_matches``, ``tool``) or the task (``task_contains``), and
in-process a script or a step may be a function of a :class:`ScriptRequest` returning a step: see
``selection``. ``ScriptedModel([...])`` or ``ScriptedModel(function)`` sets the ``default`` script.

``stop_reason`` defaults to ``tool_use`` when there are ``tool_calls``, else ``end_turn``; with
``stop_sequence`` the response's ``stop_sequence`` is ``"###"``. A step with none of ``text``,
``thinking`` and ``tool_calls`` answers with the text "Done.". Keys starting with ``_`` are comments.
Injected errors are counted per (first user message text, script, step index).

Other endpoints: ``GET /_stats``, ``POST /_scripts`` (JSON body replaces the scripts), ``POST /_reset``
(zero the counters, forget injected-error counters and the prompt cache).

Run standalone: ``python -m agentpool.testing.scripted_model --port 8765 [--host 127.0.0.1] [--scripts f.json]``.
Streaming (``stream: true``) is not supported and is rejected with a 400.
"""

from agentpool.testing.scripted_model.common import ApiError, sign_thinking
from agentpool.testing.scripted_model.scripts import ScriptBook, load_scripts
from agentpool.testing.scripted_model.selection import ScriptRequest, ToolResult
from agentpool.testing.scripted_model.server import ScriptedModel
from agentpool.testing.scripted_model.validation import validate_request

__all__ = [
    "ApiError",
    "ScriptBook",
    "ScriptRequest",
    "ScriptedModel",
    "ToolResult",
    "load_scripts",
    "sign_thinking",
    "validate_request",
]
