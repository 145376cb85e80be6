"""A scripted, strict stand-in for the Anthropic Messages API (``POST /v1/messages``, streamed or not).

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

A tool call may name a tool the request does not offer, and its ``input`` may be any object whatever
the tool's schema says (a wrong type, a missing field): these are a model's mistakes, which a test
scripts to see the client handle them. Such a tool_use gets an id signed by this server, so a later
request may send it back although ``tools`` lack its name (a tool_use the client names after a tool it
dropped from ``tools`` is still a 400).

A step may instead hold ``branches``, chosen by ``when`` conditions on the last tool results
(``is_error``, ``result_contains``, ``result_matches``, ``tool``) or the task (``task_contains``), and
in-process a script or a step may be a function of a :class:`ScriptRequest` returning a step: see
``selection``. ``ScriptedModel([...])`` or ``ScriptedModel(function)`` sets the ``default`` script.

Two more keys script long runs: ``"stream"`` (how the step streams: delta size, pace, pings, and a
cut midway: an ``error`` event after the 200, a dropped connection, a silence; see ``sse.py``) and
``"summary"`` (``{"error": ..., "stream": ..., "text": ...}``: what happens when a client asks for a
summary before this step; see ``compaction.py``). A summary longer than the request's ``max_tokens`` (at 4
characters a token) ends there, with ``stop_reason: max_tokens``, as the API's does.

``stop_reason`` defaults to ``tool_use`` when there are ``tool_calls``, else ``end_turn``; with
``stop_sequence`` the response's ``stop_sequence`` is ``"###"``. A step with none of ``text``,
``thinking`` and ``tool_calls`` answers with the text "Done.". Keys starting with ``_`` are comments.
Injected errors are counted per (first user message text, script, step index).

Long runs, as the API does them (``compaction.py``): input tokens grow with the request (4 characters a
token, cache reads and writes as the API counts them); a request past ``context_window`` tokens
(200,000 by default) is refused ("prompt is too long") and a reply that would run past it is cut with
``model_context_window_exceeded``; with the ``compact-2026-01-12`` beta and a ``compact_20260112`` edit
a request past its trigger is compacted (the reply starts with a signed ``compaction`` block, its tokens
in ``usage.iterations``) and later requests must send that block back verbatim, first; the
``clear_tool_uses_20250919`` edit clears old tool results. A request ending with agentpool's summary
prompt gets a summary. Step selection survives compaction (the number of turns compacted away travels in
the block, or in the summary's text).

Rate limits, as the API enforces them (``ratelimit.py``): ``ScriptedModel(rate_limits=RateLimits(rpm=600,
itpm=200_000, otpm=40_000, minute=6))`` (or ``set_rate_limits``) keeps token buckets per (scaled) minute
for requests, input tokens (cache reads do not count) and output tokens (``max_tokens`` held while the
reply is made), sends the ``anthropic-ratelimit-*`` headers on every reply and a 429 ``rate_limit_error``
with ``retry-after`` beyond them. ``reset()`` refills the buckets.

Other endpoints: ``GET /_stats`` (what ``stats()`` returns: requests and responses, the tokens of every
reply served by kind, rejections...), ``POST /_scripts`` (JSON body replaces the scripts), ``POST /_reset``
(zero the counters, forget injected-error counters and the prompt cache).
``ScriptedModel.delta_times()`` tells when each text delta left the server (for latency figures).

Run standalone: ``python -m agentpool.testing.scripted_model --port 8765 [--host 127.0.0.1] [--scripts f.json]
[--context-window N] [--rpm N] [--itpm N] [--otpm N] [--minute SECONDS]``.
"""

from agentpool.testing.scripted_model.common import ApiError, sign_thinking
from agentpool.testing.scripted_model.ratelimit import RateLimits
from agentpool.testing.scripted_model.scripts import ScriptBook, load_scripts
from agentpool.testing.scripted_model.selection import ScriptRequest, ToolResult
from agentpool.testing.scripted_model.server import ScriptedModel
from agentpool.testing.scripted_model.validation import validate_request

__all__ = [
    "ApiError",
    "RateLimits",
    "ScriptBook",
    "ScriptRequest",
    "ScriptedModel",
    "ToolResult",
    "load_scripts",
    "sign_thinking",
    "validate_request",
]
