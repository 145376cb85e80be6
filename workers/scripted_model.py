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

``stop_reason`` defaults to ``tool_use`` when there are ``tool_calls``, else ``end_turn``; with
``stop_sequence`` the response's ``stop_sequence`` is ``"###"``. A step with none of ``text``,
``thinking`` and ``tool_calls`` answers with the text "Done.". Keys starting with ``_`` are comments.
Injected errors are counted per (first user message text, script, step index).

Other endpoints: ``GET /_stats``, ``POST /_scripts`` (JSON body replaces the scripts), ``POST /_reset``
(zero the counters, forget injected-error counters and the prompt cache).

Run standalone: ``python -m workers.scripted_model --port 8765 [--host 127.0.0.1] [--scripts f.json]``.
Streaming (``stream: true``) is not supported and is rejected with a 400.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import hmac
import http.server
import json
import re
import secrets
import signal
import socket
import string
import sys
import threading
import time
import urllib.parse
from typing import Any, Callable

__all__ = ["ScriptedModel", "load_scripts", "main"]

# Signatures only need to be unforgeable by the client and stable within one server process.
_SIGNING_SECRET = secrets.token_bytes(32)
_BASE62 = string.ascii_letters + string.digits
_SCRIPT_MARKER = re.compile(r"\[script:([^\]\s]+)\]")
_TOOL_ID_PATTERN = re.compile(r"^[a-zA-Z0-9_-]+$")
_TOOL_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")

DONE_TEXT = "Done."
DEFAULT_SCRIPT = "default"
STOP_SEQUENCE = "###"
MAX_CACHE_BREAKPOINTS = 4
MAX_REJECTIONS_KEPT = 50
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}

STOP_REASONS = frozenset(
    {"end_turn", "stop_sequence", "tool_use", "pause_turn", "max_tokens", "refusal",
     "model_context_window_exceeded"}
)
STEP_KEYS = frozenset({"text", "thinking", "tool_calls", "stop_reason", "delay", "error", "usage"})

# Keys each request content block type may carry (the API answers "Extra inputs are not permitted"
# for anything else). Taken from the SDK's *BlockParam TypedDicts.
_BLOCK_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text", "citations", "cache_control"}),
    "image": frozenset({"type", "source", "cache_control", "transformations"}),
    "document": frozenset({"type", "source", "title", "context", "citations", "cache_control"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control",
                              "toolset_name"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "server_tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "web_search_tool_result": frozenset({"type", "tool_use_id", "content", "cache_control", "caller"}),
}
# Required keys and the JSON type each must have.
_BLOCK_REQUIRED: dict[str, dict[str, type]] = {
    "text": {"text": str},
    "image": {"source": dict},
    "document": {"source": dict},
    "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str},
    "thinking": {"thinking": str, "signature": str},
    "redacted_thinking": {"data": str},
    "server_tool_use": {"id": str, "name": str, "input": dict},
    "web_search_tool_result": {"tool_use_id": str, "content": object},
}
_TOOL_RESULT_CONTENT_TYPES = ("text", "image", "document", "search_result")
_JSON_TYPE_WORDS = {
    str: "a valid string", dict: "a valid dictionary", list: "a valid list", bool: "a valid boolean",
    int: "a valid integer", float: "a valid number",
}
# What the API's validator says when a careless model_dump() sends a None it does not accept.
_NULL_MESSAGES = {
    "citations": "Input should be a valid list",
    "caller": "Input should be a valid dictionary or object to extract fields from",
    "cache_control": "Input should be a valid dictionary or object to extract fields from",
    "input": "Input should be a valid dictionary",
    "source": "Input should be a valid dictionary or object to extract fields from",
    "is_error": "Input should be a valid boolean",
    "content": "Input should be a valid list",
}

_ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 408: "timeout_error", 409: "conflict_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error",
    503: "api_error", 504: "timeout_error", 529: "overloaded_error",
}


class ApiError(Exception):
    """An error answered in the API's error shape."""

    def __init__(self, status: int, err_type: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message
        self.headers = headers or {}


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


def _random_id(prefix: str, length: int = 24) -> str:
    return prefix + "".join(secrets.choice(_BASE62) for _ in range(length))


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _tokens(text: str) -> int:
    return max(1, len(text) // 4)


def sign_thinking(thinking: str) -> str:
    """Signature of a thinking block; only this process can make one that verifies."""
    digest = hmac.new(_SIGNING_SECRET, thinking.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


# --------------------------------------------------------------------------------------------------
# Scripts
# --------------------------------------------------------------------------------------------------

def _validate_step(where: str, step: Any) -> None:
    if not isinstance(step, dict):
        raise ValueError(f"{where}: a step must be an object")
    unknown = [k for k in step if k not in STEP_KEYS and not k.startswith("_")]
    if unknown:
        raise ValueError(f"{where}: unknown step keys {unknown}; allowed: {sorted(STEP_KEYS)}")
    for key in ("text", "thinking"):
        if key in step and not isinstance(step[key], str):
            raise ValueError(f"{where}.{key}: must be a string")
    for i, call in enumerate(step.get("tool_calls") or []):
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("input", {}), dict)):
            raise ValueError(f"{where}.tool_calls.{i}: must be {{'name': str, 'input': dict}}")
    if "stop_reason" in step and step["stop_reason"] not in STOP_REASONS:
        raise ValueError(f"{where}.stop_reason: must be one of {sorted(STOP_REASONS)}")
    if "delay" in step and (not isinstance(step["delay"], (int, float)) or step["delay"] < 0):
        raise ValueError(f"{where}.delay: must be a non-negative number of seconds")
    if "usage" in step and not isinstance(step["usage"], dict):
        raise ValueError(f"{where}.usage: must be an object")
    if "error" in step:
        err = step["error"]
        if not isinstance(err, dict) or not isinstance(err.get("status"), int):
            raise ValueError(f"{where}.error: must be an object with an integer 'status'")
        if not 400 <= err["status"] <= 599:
            raise ValueError(f"{where}.error.status: must be a 4xx or 5xx status")


def _validate_scripts(scripts: Any) -> dict[str, list[dict]]:
    """Check a scripts dict up front: a malformed script is a test bug and should fail loudly."""
    if scripts is None:
        return {}
    if not isinstance(scripts, dict):
        raise ValueError("scripts must be an object mapping script names to lists of steps")
    for name, steps in scripts.items():
        if not isinstance(name, str) or not isinstance(steps, list):
            raise ValueError(f"script {name!r}: must map a string name to a list of steps")
        for i, step in enumerate(steps):
            _validate_step(f"{name}.{i}", step)
    return copy.deepcopy(scripts)


def load_scripts(path: str) -> dict:
    """Read a scripts JSON file (``{name: [step, ...]}``) and validate it."""
    with open(path, encoding="utf-8") as f:
        return _validate_scripts(json.load(f))


# --------------------------------------------------------------------------------------------------
# Request validation (messages like the API's; see module docstring)
# --------------------------------------------------------------------------------------------------

def _check_type(path: str, value: Any, expected: type | tuple[type, ...], what: str) -> None:
    # bool is an int subclass in Python but never a valid number/integer in JSON Schema terms.
    if isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,)):
        raise _invalid(f"{path}: Input should be {what}")
    if not isinstance(value, expected):
        raise _invalid(f"{path}: Input should be {what}")


def _validate_top_level(body: dict) -> None:
    for key in ("model", "max_tokens", "messages"):
        if key not in body:
            raise _invalid(f"{key}: Field required")
    _check_type("model", body["model"], str, "a valid string")
    _check_type("max_tokens", body["max_tokens"], int, "a valid integer")
    if body["max_tokens"] < 1:
        raise _invalid("max_tokens: Input should be greater than or equal to 1")
    _check_type("messages", body["messages"], list, "a valid list")
    if not body["messages"]:
        raise _invalid("messages: at least one message is required")
    typed = {
        "system": ((str, list), "a valid string or list"), "tools": (list, "a valid list"),
        "tool_choice": (dict, "a valid dictionary"), "stop_sequences": (list, "a valid list"),
        "temperature": ((int, float), "a valid number"), "top_p": ((int, float), "a valid number"),
        "top_k": (int, "a valid integer"), "metadata": (dict, "a valid dictionary"),
        "stream": (bool, "a valid boolean"), "thinking": (dict, "a valid dictionary"),
    }
    for key, (expected, what) in typed.items():
        if key in body:
            _check_type(key, body[key], expected, what)
    if body.get("stream"):
        raise _invalid("stream: the scripted model only supports non-streaming requests")
    for i, seq in enumerate(body.get("stop_sequences") or []):
        _check_type(f"stop_sequences.{i}", seq, str, "a valid string")
    _validate_thinking_config(body)


def _validate_thinking_config(body: dict) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _invalid("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise _invalid("thinking.enabled.budget_tokens: Field required")
        if budget < 1024:
            raise _invalid("thinking.enabled.budget_tokens: Input should be greater than or equal to 1024")
        if budget >= body["max_tokens"]:
            raise _invalid("`max_tokens` must be greater than `thinking.budget_tokens`.")


def _validate_cache_control(path: str, value: Any) -> None:
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise _invalid(f"{path}.type: Input should be 'ephemeral'")
    if "ttl" in value and value["ttl"] not in CACHE_TTLS:
        raise _invalid(f"{path}.ttl: Input should be '5m' or '1h'")


def _validate_tools(tools: list | None) -> set[str]:
    """Validate ``tools``; return the names of the custom (client) tools."""
    names: set[str] = set()
    custom: set[str] = set()
    for i, tool in enumerate(tools or []):
        path = f"tools.{i}"
        _check_type(path, tool, dict, "a valid dictionary")
        is_custom = tool.get("type") in (None, "custom")
        tag = "custom" if is_custom else str(tool.get("type"))
        for key, value in tool.items():
            if value is None and key not in ("type", "cache_control", "eager_input_streaming"):
                raise _invalid(f"{path}.{tag}.{key}: Input should not be null")
        name = tool.get("name")
        if not isinstance(name, str):
            raise _invalid(f"{path}.{tag}.name: Field required")
        if is_custom:
            if not _TOOL_NAME_PATTERN.match(name):
                raise _invalid(f"{path}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise _invalid(f"{path}.custom.input_schema: Field required")
            if schema.get("type") != "object":
                raise _invalid(f"{path}.custom.input_schema.type: Input should be 'object'")
            custom.add(name)
        if tool.get("cache_control") is not None:
            _validate_cache_control(f"{path}.{tag}.cache_control", tool["cache_control"])
        if name in names:
            raise _invalid("tools: Tool names must be unique.")
        names.add(name)
    return custom


def _validate_tool_choice(body: dict, tool_names: set[str]) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise _invalid("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
    if kind == "tool" and choice.get("name") not in tool_names:
        raise _invalid(f"tool_choice.tool.name: tool `{choice.get('name')}` is not defined in `tools`")
    if kind in ("any", "tool") and not body.get("tools"):
        raise _invalid("tool_choice: `tools` must be provided when `tool_choice` requires a tool")


def _validate_system(system: Any) -> None:
    if not isinstance(system, list):
        return
    for i, block in enumerate(system):
        path = f"system.{i}"
        _check_type(path, block, dict, "a valid dictionary")
        if block.get("type") != "text":
            raise _invalid(f"{path}.type: Input should be 'text'")
        _validate_block_keys(path, block, "text")


def _validate_block_keys(path: str, block: dict, kind: str) -> None:
    """Nulls, extra keys and required keys of one content block."""
    for key, value in block.items():
        # The API accepts some nulls (e.g. cache_control), but a null here nearly always comes from
        # model_dump() instead of to_dict(mode="json"); we reject every null to catch that early.
        if value is None:
            if kind == "document" and key == "citations":
                raise _invalid(f"{path}.{key}: Input should be a valid dictionary")
            raise _invalid(f"{path}.{key}: {_NULL_MESSAGES.get(key, 'Input should be a valid string')}")
        if key not in _BLOCK_KEYS[kind]:
            raise _invalid(f"{path}.{kind}.{key}: Extra inputs are not permitted")
    for key, expected in _BLOCK_REQUIRED[kind].items():
        if key not in block:
            raise _invalid(f"{path}.{kind}.{key}: Field required")
        if expected is not object and not isinstance(block[key], expected):
            raise _invalid(f"{path}.{kind}.{key}: Input should be {_JSON_TYPE_WORDS[expected]}")
    if "cache_control" in block:
        _validate_cache_control(f"{path}.{kind}.cache_control", block["cache_control"])
    if "citations" in block and kind == "text" and not isinstance(block["citations"], list):
        raise _invalid(f"{path}.citations: Input should be a valid list")
    if kind == "text" and not block["text"]:
        raise _invalid("messages: text content blocks must be non-empty")


def _block_type(path: str, block: Any) -> str:
    if not isinstance(block, dict):
        raise _invalid(f"{path}: Input should be a valid dictionary")
    kind = block.get("type")
    if kind not in _BLOCK_KEYS:
        expected = ", ".join(f"'{k}'" for k in _BLOCK_KEYS)
        raise _invalid(f"{path}: Input tag '{kind}' found using 'type' does not match any of the "
                       f"expected tags: {expected}")
    return kind


def _validate_tool_result(path: str, block: dict) -> None:
    if "is_error" in block and not isinstance(block["is_error"], bool):
        raise _invalid(f"{path}.tool_result.is_error: Input should be a valid boolean")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _invalid(f"{path}.tool_result.content: Input should be a valid list")
    for k, sub in enumerate(content):
        sub_path = f"{path}.content.{k}"
        if not isinstance(sub, dict) or sub.get("type") not in _TOOL_RESULT_CONTENT_TYPES:
            kind = sub.get("type") if isinstance(sub, dict) else None
            raise _invalid(f"{sub_path}: Input tag '{kind}' found using 'type' does not match any of "
                           f"the expected tags: " + ", ".join(f"'{t}'" for t in _TOOL_RESULT_CONTENT_TYPES))
        if sub["type"] in _BLOCK_KEYS:
            _validate_block_keys(sub_path, sub, sub["type"])


def _validate_block(path: str, block: Any, role: str, tool_names: set[str], has_tools: bool,
                    seen_ids: set[str]) -> str:
    kind = _block_type(path, block)
    _validate_block_keys(path, block, kind)
    if kind in ("tool_use", "server_tool_use", "thinking", "redacted_thinking") and role != "assistant":
        raise _invalid(f"{path}: `{kind}` blocks can only be in `assistant` messages")
    if kind == "tool_result" and role != "user":
        raise _invalid(f"{path}: `tool_result` blocks can only be in `user` messages")
    if kind in ("tool_use", "tool_result") and not has_tools:
        raise _invalid("Requests which include `tool_use` or `tool_result` blocks must define tools.")
    if kind in ("tool_use", "server_tool_use"):
        if not _TOOL_ID_PATTERN.match(block["id"]):
            raise _invalid(f"{path}.{kind}.id: String should match pattern '^[a-zA-Z0-9_-]+$'")
        if block["id"] in seen_ids:
            raise _invalid(f"{path}: `tool_use` ids must be unique")
        seen_ids.add(block["id"])
    if kind == "tool_use" and block["name"] not in tool_names:
        raise _invalid(f"{path}: tool_use block names the tool `{block['name']}`, which is not "
                       f"defined in `tools`")
    if kind == "tool_result":
        _validate_tool_result(path, block)
    if kind == "thinking" and not hmac.compare_digest(block["signature"], sign_thinking(block["thinking"])):
        raise _invalid(f"{path}: Invalid `signature` in `thinking` block")
    if kind == "redacted_thinking":
        # This server never emits redacted thinking, so any such block was not made by "the model".
        raise _invalid(f"{path}: Invalid `data` in `redacted_thinking` block")
    return kind


def _message_blocks(i: int, msg: Any) -> tuple[str, list]:
    """Role and content blocks of one message (string content counts as one text block)."""
    path = f"messages.{i}"
    _check_type(path, msg, dict, "a valid dictionary")
    for key in msg:
        if key not in ("role", "content"):
            raise _invalid(f"{path}.{key}: Extra inputs are not permitted")
    if "role" not in msg:
        raise _invalid(f"{path}.role: Field required")
    if msg["role"] not in ("user", "assistant"):
        raise _invalid(f"{path}.role: Input should be 'user' or 'assistant'")
    if "content" not in msg:
        raise _invalid(f"{path}.content: Field required")
    content = msg["content"]
    if isinstance(content, str):
        return msg["role"], ([{"type": "text", "text": content}] if content else [])
    if not isinstance(content, list):
        raise _invalid(f"{path}.content: Input should be a valid string or list")
    return msg["role"], content


def _check_tool_pairing(parsed: list[tuple[str, list]]) -> None:
    """Every tool_use answered by exactly one tool_result, first in the very next user message."""
    for j, (role, blocks) in enumerate(parsed):
        prev_ids = _tool_use_ids(parsed[j - 1][1]) if j > 0 and parsed[j - 1][0] == "assistant" else []
        if role == "assistant":
            ids = _tool_use_ids(blocks)
            if ids and (j + 1 == len(parsed) or parsed[j + 1][0] != "user"):
                raise _missing_results(j, ids)
            continue
        seen: set[str] = set()
        leading: set[str] = set()
        in_leading_run = True
        for m, block in enumerate(blocks):
            if block.get("type") != "tool_result":
                in_leading_run = False
                continue
            tid = block["tool_use_id"]
            if tid not in prev_ids:
                raise _invalid(f"messages.{j}.content.{m}: unexpected `tool_use_id` found in "
                               f"`tool_result` blocks: {tid}. Each `tool_result` block must have a "
                               f"corresponding `tool_use` block in the previous message.")
            if tid in seen:
                raise _invalid(f"messages.{j}.content.{m}: multiple `tool_result` blocks found for "
                               f"`tool_use_id` {tid}. Each `tool_use` block must have exactly one "
                               f"corresponding `tool_result` block.")
            seen.add(tid)
            if in_leading_run:
                leading.add(tid)
        missing = [tid for tid in prev_ids if tid not in leading]
        if missing:
            raise _missing_results(j - 1, missing)


def _tool_use_ids(blocks: list) -> list[str]:
    return [b["id"] for b in blocks if b.get("type") == "tool_use"]


def _missing_results(i: int, ids: list[str]) -> ApiError:
    return _invalid(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately "
                    f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding "
                    f"`tool_result` block in the next message.")


def _validate_messages(messages: list, tool_names: set[str], has_tools: bool) -> None:
    parsed: list[tuple[str, list]] = []
    seen_ids: set[str] = set()
    for i, msg in enumerate(messages):
        role, blocks = _message_blocks(i, msg)
        if i == 0 and role != "user":
            raise _invalid('messages: first message must use the "user" role')
        if not blocks and i != len(messages) - 1:
            raise _invalid(f"messages.{i}: all messages must have non-empty content except for the "
                           f"optional final assistant message")
        for m, block in enumerate(blocks):
            _validate_block(f"messages.{i}.content.{m}", block, role, tool_names, has_tools, seen_ids)
        parsed.append((role, blocks))
    last_role, last_blocks = parsed[-1]
    if last_role == "user" and not last_blocks:
        raise _invalid(f"messages.{len(parsed) - 1}: all messages must have non-empty content except "
                       f"for the optional final assistant message")
    if last_role == "assistant" and last_blocks and last_blocks[-1].get("type") == "text" \
            and last_blocks[-1]["text"] != last_blocks[-1]["text"].rstrip():
        raise _invalid("messages: final assistant content cannot end with trailing whitespace")
    _check_tool_pairing(parsed)


def _count_cache_markers(body: dict) -> int:
    return len(_cache_units(body)[1])


def validate_request(body: Any) -> None:
    """Raise :class:`ApiError` (400) for anything the Messages API would reject."""
    if not isinstance(body, dict):
        raise _invalid("Request body must be a JSON object")
    _validate_top_level(body)
    tool_names = _validate_tools(body.get("tools"))
    _validate_tool_choice(body, tool_names)
    _validate_system(body.get("system"))
    _validate_messages(body["messages"], tool_names, bool(body.get("tools")))
    markers = _count_cache_markers(body)
    if markers > MAX_CACHE_BREAKPOINTS:
        raise _invalid(f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be "
                       f"provided. Found {markers}.")


# --------------------------------------------------------------------------------------------------
# Token estimates and prompt caching
# --------------------------------------------------------------------------------------------------

def _strip_cache_control(block: Any) -> tuple[Any, str | None]:
    """Block without cache_control (also inside tool_result content) and the marker's TTL, if any."""
    if not isinstance(block, dict):
        return block, None
    ttl = None
    stripped = {k: v for k, v in block.items() if k != "cache_control"}
    if block.get("cache_control"):
        ttl = block["cache_control"].get("ttl", "5m")
    if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
        inner = []
        for sub in block["content"]:
            sub_stripped, sub_ttl = _strip_cache_control(sub)
            inner.append(sub_stripped)
            ttl = ttl or sub_ttl
        stripped["content"] = inner
    return stripped, ttl


def _cache_units(body: dict) -> tuple[list, list[tuple[int, str]]]:
    """The prompt as an ordered list of units (tools, system, message blocks) without cache_control,
    and the (unit index, ttl) of every cache breakpoint, in the API's prefix order."""
    units: list = []
    markers: list[tuple[int, str]] = []

    def add(unit: Any, ttl: str | None) -> None:
        units.append(unit)
        if ttl:
            markers.append((len(units) - 1, ttl))

    for tool in body.get("tools") or []:
        stripped, ttl = _strip_cache_control(tool)
        add(["tool", stripped], ttl)
    system = body.get("system")
    if isinstance(system, str):
        add(["system", system], None)
    elif isinstance(system, list):
        for block in system:
            stripped, ttl = _strip_cache_control(block)
            add(["system", stripped], ttl)
    for i, msg in enumerate(body.get("messages") or []):
        content = msg.get("content") if isinstance(msg, dict) else None
        role = msg.get("role") if isinstance(msg, dict) else None
        if isinstance(content, str):
            add(["message", i, role, content], None)
            continue
        for block in content or []:
            stripped, ttl = _strip_cache_control(block)
            add(["message", i, role, stripped], ttl)
    return units, markers


class _PromptCache:
    """Remembers prefix hashes until they expire (5 min, or 1 h with ttl "1h"), like the API's cache."""

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens
        self._expiry: dict[str, float] = {}

    def clear(self) -> None:
        self._expiry.clear()

    def usage(self, body: dict) -> dict[str, int]:
        """Input-side usage for one request; caller holds the model's lock."""
        units, markers = _cache_units(body)
        total = _tokens(_canonical(units))
        now = time.monotonic()
        self._expiry = {k: t for k, t in self._expiry.items() if t > now}
        prefixes = []
        for pos, ttl in markers:
            text = _canonical(units[: pos + 1])
            tokens = len(text) // 4
            if tokens >= self.min_tokens:  # shorter prefixes are silently not cached, as in the API
                key = hashlib.sha256(f"{body['model']}\0{text}".encode("utf-8")).hexdigest()
                prefixes.append((tokens, key, CACHE_TTLS[ttl]))
        read = max((tokens for tokens, key, _ in prefixes if key in self._expiry), default=0)
        longest = max((tokens for tokens, _, _ in prefixes), default=0)
        creation = longest - read
        for _, key, ttl_s in prefixes:  # a hit refreshes the entry's lifetime, as in the API
            self._expiry[key] = max(self._expiry.get(key, 0.0), now + ttl_s)
        return {
            "input_tokens": max(0, total - read - creation),
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": read,
        }


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------

def _first_user_text(messages: list) -> str:
    content = messages[0].get("content")
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], model: "ScriptedModel") -> None:
        self.model = model
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    # Track keep-alive connections so stop() can close them: otherwise a client's pooled connection
    # would keep being served by a handler thread after the server "stopped".
    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real API; every reply sets Content-Length
    disable_nagle_algorithm = True  # else Nagle + delayed ACK add ~40 ms to every reply
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet: tests and the demo run many requests; /_stats is the way to look inside

    def do_GET(self) -> None:
        self.server.model._dispatch(self, "GET")

    def do_POST(self) -> None:
        self.server.model._dispatch(self, "POST")

    def do_PUT(self) -> None:
        self.server.model._dispatch(self, "PUT")

    def do_DELETE(self) -> None:
        self.server.model._dispatch(self, "DELETE")

    def do_PATCH(self) -> None:
        self.server.model._dispatch(self, "PATCH")


class ScriptedModel:
    """Scripted Messages API server. ``ScriptedModel(scripts).start()`` then use ``base_url``."""

    def __init__(self, scripts: dict[str, list[dict]] | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, cache_min_tokens: int = 1024) -> None:
        self._scripts = _validate_scripts(scripts)
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._cache = _PromptCache(cache_min_tokens)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._routes: dict[str, dict[str, Callable[[Any], tuple[int, dict]]]] = {
            "/v1/messages": {"POST": self._handle_messages},
            "/_stats": {"GET": lambda _body: (200, self.stats())},
            "/_scripts": {"POST": self._handle_set_scripts},
            "/_reset": {"POST": self._handle_reset},
        }
        self._reset_counters()

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "ScriptedModel":
        if self._server is not None:
            return self
        self._server = _Server((self._host, self._port), self)
        # A short poll interval keeps stop() (which waits for the next poll) fast in test teardown.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="scripted-model", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.close_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "ScriptedModel":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("ScriptedModel is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ---- state -----------------------------------------------------------------------------------

    def _reset_counters(self) -> None:
        with self._lock:
            self._counts = {"requests": 0, "responses": 0, "rejected": 0, "errors_injected": 0}
            self._rejections: list[str] = []
            self._by_script: dict[str, int] = {}
            self._error_hits: dict[tuple[str, str, int], int] = {}
            self._cache.clear()

    def reset(self) -> None:
        self._reset_counters()

    def stats(self) -> dict:
        with self._lock:
            return {**self._counts, "rejections": list(self._rejections), "by_script": dict(self._by_script)}

    def set_scripts(self, scripts: dict[str, list[dict]]) -> None:
        validated = _validate_scripts(scripts)
        with self._lock:
            self._scripts = validated

    # ---- HTTP plumbing ---------------------------------------------------------------------------

    def _dispatch(self, handler: _Handler, method: str) -> None:
        request_id = _random_id("req_")
        try:
            # Read the body even for a request we reject: with keep-alive, unread bytes would be
            # taken for the next request on this connection.
            raw = self._read_raw_body(handler)
            path = urllib.parse.urlsplit(handler.path).path.rstrip("/") or "/"
            methods = self._routes.get(path)
            if methods is None:
                raise ApiError(404, "not_found_error", f"Not found: {method} {path}")
            if method not in methods:
                raise ApiError(405, "invalid_request_error", f"Method {method} not allowed for {path}",
                               {"allow": ", ".join(methods)})
            if path == "/v1/messages":
                with self._lock:
                    self._counts["requests"] += 1
                self._check_auth(handler)
            status, payload = methods[method](_parse_json(raw))
            self._send(handler, status, payload, request_id, {})
        except _InjectedError as injected:
            self._send(handler, injected.error.status, _error_body(injected.error, request_id), request_id,
                       injected.error.headers)
        except ApiError as err:
            self._record_rejection(err.message)
            self._send(handler, err.status, _error_body(err, request_id), request_id, err.headers)

    @staticmethod
    def _read_raw_body(handler: _Handler) -> bytes:
        try:
            length = int(handler.headers.get("content-length") or 0)
        except ValueError:
            raise _invalid("Content-Length header is not an integer") from None
        return handler.rfile.read(length) if length > 0 else b""

    @staticmethod
    def _check_auth(handler: _Handler) -> None:
        # Presence only: the value is never compared, logged or stored.
        bearer = handler.headers.get("authorization", "")
        has_bearer = bearer.lower().startswith("bearer ") and bearer[7:].strip() != ""
        if not (handler.headers.get("x-api-key") or has_bearer):
            raise ApiError(401, "authentication_error", "x-api-key header is required")
        if not handler.headers.get("anthropic-version"):
            raise _invalid("anthropic-version: header is required")

    @staticmethod
    def _send(handler: _Handler, status: int, payload: dict, request_id: str,
              headers: dict[str, str]) -> None:
        data = json.dumps(payload).encode("utf-8")
        try:
            handler.send_response(status)
            handler.send_header("content-type", "application/json")
            handler.send_header("content-length", str(len(data)))
            handler.send_header("request-id", request_id)
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (e.g. its timeout fired during a scripted delay)

    def _record_rejection(self, message: str) -> None:
        with self._lock:
            self._counts["rejected"] += 1
            self._rejections.append(message)
            del self._rejections[:-MAX_REJECTIONS_KEPT]

    # ---- endpoints -------------------------------------------------------------------------------

    def _handle_set_scripts(self, body: Any) -> tuple[int, dict]:
        if not isinstance(body, dict):
            raise _invalid("POST /_scripts needs a JSON object mapping script names to lists of steps")
        try:
            self.set_scripts(body)
        except ValueError as exc:
            raise _invalid(str(exc)) from None
        return 200, {"ok": True, "scripts": sorted(self._scripts)}

    def _handle_reset(self, _body: Any) -> tuple[int, dict]:
        self.reset()
        return 200, {"ok": True}

    def _handle_messages(self, body: Any) -> tuple[int, dict]:
        validate_request(body)
        messages = body["messages"]
        first_text = _first_user_text(messages)
        name, steps = self._select_script(first_text)
        index = sum(1 for m in messages if m["role"] == "assistant")
        step = steps[index] if index < len(steps) else {}
        _check_tool_calls_defined(name, index, step, body)
        if step.get("delay"):
            time.sleep(float(step["delay"]))
        self._maybe_inject_error(first_text, name, index, step)
        content = _build_content(step)
        stop_reason = step.get("stop_reason") or ("tool_use" if step.get("tool_calls") else "end_turn")
        with self._lock:
            usage = self._cache.usage(body)
            self._counts["responses"] += 1
            self._by_script[name] = self._by_script.get(name, 0) + 1
        usage["output_tokens"] = _tokens(_canonical(content))
        usage.update(step.get("usage") or {})
        return 200, {
            "id": _random_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": STOP_SEQUENCE if stop_reason == "stop_sequence" else None,
            "usage": usage,
        }

    def _select_script(self, first_text: str) -> tuple[str, list[dict]]:
        match = _SCRIPT_MARKER.search(first_text)
        with self._lock:
            scripts = self._scripts
        if match is None:
            return DEFAULT_SCRIPT, scripts.get(DEFAULT_SCRIPT, [])
        name = match.group(1)
        if name in scripts:
            return name, scripts[name]
        if name == DEFAULT_SCRIPT:
            return name, []
        raise _invalid(f"[scripted model] unknown script {name!r} named by the [script:{name}] marker "
                       f"in the first user message; known scripts: {sorted(scripts)}")

    def _maybe_inject_error(self, first_text: str, name: str, index: int, step: dict) -> None:
        spec = step.get("error")
        if not spec:
            return
        key = (hashlib.sha256(first_text.encode("utf-8")).hexdigest(), name, index)
        with self._lock:
            served = self._error_hits.get(key, 0)
            if served >= int(spec.get("times", 1)):
                return
            self._error_hits[key] = served + 1
            self._counts["errors_injected"] += 1
        status = int(spec["status"])
        # x-should-retry: false stops the SDK from retrying on its own: its retries would consume
        # the scripted failures invisibly (and honour retry-after inside create()). Callers that
        # want retries set max_retries and handle them, so every scripted error reaches the caller.
        headers = {"x-should-retry": "false"}
        if spec.get("retry_after") is not None:
            headers["retry-after"] = str(spec["retry_after"])
        raise _InjectedError(ApiError(status, spec.get("type") or _ERROR_TYPE_BY_STATUS.get(status, "api_error"),
                                      spec.get("message") or f"Injected error {status}", headers))


class _InjectedError(Exception):
    """A scripted error: answered like any API error, but counted as injected, not as a rejection."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def _parse_json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _invalid(f"There was an error parsing the body: {exc}") from None


def _error_body(err: ApiError, request_id: str) -> dict:
    return {"type": "error", "error": {"type": err.err_type, "message": err.message},
            "request_id": request_id}


def _check_tool_calls_defined(name: str, index: int, step: dict, body: dict) -> None:
    # A script calling a tool the request did not offer would only be rejected on the next turn;
    # fail on this one so the test bug is reported where it is.
    offered = {t.get("name") for t in body.get("tools") or []}
    for call in step.get("tool_calls") or []:
        if call["name"] not in offered:
            raise _invalid(f"[scripted model] script {name!r} step {index} calls tool "
                           f"{call['name']!r}, which the request's `tools` do not define")


def _build_content(step: dict) -> list[dict]:
    content: list[dict] = []
    if "thinking" in step:
        content.append({"type": "thinking", "thinking": step["thinking"],
                        "signature": sign_thinking(step["thinking"])})
    if "text" in step:
        content.append({"type": "text", "text": step["text"]})
    for call in step.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": _random_id("toolu_"), "name": call["name"],
                        "input": copy.deepcopy(call.get("input", {}))})
    if not content:
        content.append({"type": "text", "text": DONE_TEXT})
    return content


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.scripted_model",
                                     description="Scripted stand-in for the Anthropic Messages API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--scripts", help="JSON file mapping script names to lists of steps")
    parser.add_argument("--cache-min-tokens", type=int, default=1024)
    args = parser.parse_args(argv)

    scripts = load_scripts(args.scripts) if args.scripts else None
    model = ScriptedModel(scripts, host=args.host, port=args.port,
                          cache_min_tokens=args.cache_min_tokens).start()
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    print(f"listening on {model.base_url}", flush=True)
    try:
        # Poll so the signal handler gets to run promptly in the main thread.
        while not stopping.wait(0.2):
            pass
    finally:
        model.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
