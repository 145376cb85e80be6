"""Scripts: what the scripted model answers at each step, and the errors it injects (see the package
docstring for the format; ``selection`` for branches and script functions)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
import time
from typing import Any

from agentpool.testing.scripted_model.common import (
    ERROR_TYPE_BY_STATUS,
    ApiError,
    invalid,
    random_id,
    sign_thinking,
    unoffered_tool_use_id,
)
from agentpool.testing.scripted_model.selection import request_of, resolve, validate_branches
from agentpool.testing.scripted_model.sse import validate_stream_options

SCRIPT_MARKER = re.compile(r"\[script:([^\]\s]+)\]")


DONE_TEXT = "Done."


DEFAULT_SCRIPT = "default"


STOP_SEQUENCE = "###"


STOP_REASONS = frozenset(
    {"end_turn", "stop_sequence", "tool_use", "pause_turn", "max_tokens", "refusal", "model_context_window_exceeded"}
)


STEP_KEYS = frozenset({"text", "thinking", "tool_calls", "stop_reason", "delay", "error", "usage", "stream", "summary"})
# "summary": what the model does when a client asks it for a summary at this step (see compaction.py).
SUMMARY_KEYS = frozenset({"error", "stream", "text"})


def _validate_step(where: str, step: Any) -> None:
    if not isinstance(step, dict):
        raise ValueError(f"{where}: a step must be an object")
    if "branches" in step:
        validate_branches(where, step, _validate_step)
        return
    unknown = [k for k in step if k not in STEP_KEYS and not k.startswith("_")]
    if unknown:
        raise ValueError(f"{where}: unknown step keys {unknown}; allowed: {sorted(STEP_KEYS)}")
    for key in ("text", "thinking"):
        if key in step and not isinstance(step[key], str):
            raise ValueError(f"{where}.{key}: must be a string")
    for i, call in enumerate(step.get("tool_calls") or []):
        if not (
            isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("input", {}), dict)
        ):
            raise ValueError(f"{where}.tool_calls.{i}: must be {{'name': str, 'input': dict}}")
    if "stop_reason" in step and step["stop_reason"] not in STOP_REASONS:
        raise ValueError(f"{where}.stop_reason: must be one of {sorted(STOP_REASONS)}")
    if "delay" in step and (not isinstance(step["delay"], (int, float)) or step["delay"] < 0):
        raise ValueError(f"{where}.delay: must be a non-negative number of seconds")
    if "usage" in step and not isinstance(step["usage"], dict):
        raise ValueError(f"{where}.usage: must be an object")
    if "stream" in step:
        validate_stream_options(f"{where}.stream", step["stream"])
    if "summary" in step:
        summary = step["summary"]
        if not isinstance(summary, dict) or set(summary) - SUMMARY_KEYS:
            raise ValueError(f"{where}.summary: must be an object with keys among {sorted(SUMMARY_KEYS)}")
        _validate_step(f"{where}.summary", {k: v for k, v in summary.items() if k != "text"})
    if "error" in step:
        err = step["error"]
        if not isinstance(err, dict) or not isinstance(err.get("status"), int):
            raise ValueError(f"{where}.error: must be an object with an integer 'status'")
        if not 400 <= err["status"] <= 599:
            raise ValueError(f"{where}.error.status: must be a 4xx or 5xx status")


def validate_scripts(scripts: Any) -> dict[str, Any]:
    """Check scripts up front: a malformed script is a test bug and should fail loudly. ``scripts`` maps
    names to lists of steps (a step may be a function, in-process) or to functions; a bare list or
    function is the ``default`` script (the one a request without a ``[script:NAME]`` marker gets)."""
    if scripts is None:
        return {}
    if callable(scripts) or isinstance(scripts, list):
        scripts = {DEFAULT_SCRIPT: scripts}
    if not isinstance(scripts, dict):
        raise ValueError("scripts must be an object mapping script names to lists of steps")
    checked: dict[str, Any] = {}
    for name, steps in scripts.items():
        if not isinstance(name, str) or not (isinstance(steps, list) or callable(steps)):
            raise ValueError(f"script {name!r}: must map a string name to a list of steps (or, in-process, a function)")
        if callable(steps):
            checked[name] = steps  # called per request; what it returns is checked then
            continue
        for i, step in enumerate(steps):
            if not callable(step):
                _validate_step(f"{name}.{i}", step)
        # Copied so a test changing its dict later changes nothing here; functions are kept as they are.
        checked[name] = [step if callable(step) else copy.deepcopy(step) for step in steps]
    return checked


def load_scripts(path: str) -> dict:
    """Read a scripts JSON file (``{name: [step, ...]}``) and validate it."""
    with open(path, encoding="utf-8") as f:
        return validate_scripts(json.load(f))


def first_user_text(messages: list) -> str:
    content = messages[0].get("content")
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")


class InjectedError(Exception):
    """A scripted error: answered like any API error, but counted as injected, not as a rejection."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def build_content(step: dict, offered: set[str]) -> list[dict]:
    """The reply's content blocks. A tool call may name a tool the request does not offer (``offered``):
    that is a model's mistake a test may script, and its tool_use gets an id that lets the block be sent
    back (see ``unoffered_tool_use_id``). Its input may be any object, fields of the wrong type or
    missing included: checking it is the client's job."""
    content: list[dict] = []
    if "thinking" in step:
        content.append({"type": "thinking", "thinking": step["thinking"], "signature": sign_thinking(step["thinking"])})
    if "text" in step:
        content.append({"type": "text", "text": step["text"]})
    for call in step.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": random_id("toolu_") if call["name"] in offered else unoffered_tool_use_id(call["name"]),
                "name": call["name"],
                "input": copy.deepcopy(call.get("input", {})),
            }
        )
    if not content:
        content.append({"type": "text", "text": DONE_TEXT})
    return content


class ScriptBook:
    """The scripts a server answers from: which step a request gets, and the errors it injects.

    Selection is stateless (the step is the number of assistant messages in the request), so a call
    retried after a crash gets the same step; only injected errors are counted, per (first user
    message, script, step)."""

    def __init__(self, scripts: dict[str, list[dict]] | None = None) -> None:
        self._lock = threading.Lock()
        self._scripts = validate_scripts(scripts)
        self._error_hits: dict[tuple[str, str, int], int] = {}

    def replace(self, scripts: dict[str, list[dict]]) -> list[str]:
        validated = validate_scripts(scripts)
        with self._lock:
            self._scripts = validated
        return sorted(validated)

    def forget_errors(self) -> None:
        with self._lock:
            self._error_hits.clear()

    def step_for(self, body: dict) -> tuple[str, int, dict]:
        """(script name, step index, step) for a validated request; injects the step's error, if due."""
        name, index, step = self.peek(body)
        if step.get("delay"):
            time.sleep(float(step["delay"]))
        self._maybe_inject_error(first_user_text(body["messages"]), name, index, step)
        return name, index, step

    def peek(self, body: dict) -> tuple[str, int, dict]:
        """(script name, step index, step) for a request, without the step's delay or error."""
        messages = body["messages"]
        first_text = first_user_text(messages)
        name, script = self._select_script(first_text)
        index = sum(1 for m in messages if m["role"] == "assistant")
        return name, index, resolve(name, script, request_of(body, index, first_text), _validate_step)

    def _select_script(self, first_text: str) -> tuple[str, Any]:
        match = SCRIPT_MARKER.search(first_text)
        with self._lock:
            scripts = self._scripts
        if match is None:
            return DEFAULT_SCRIPT, scripts.get(DEFAULT_SCRIPT, [])
        name = match.group(1)
        if name in scripts:
            return name, scripts[name]
        if name == DEFAULT_SCRIPT:
            return name, []
        raise invalid(
            f"[scripted model] unknown script {name!r} named by the [script:{name}] marker "
            f"in the first user message; known scripts: {sorted(scripts)}"
        )

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
        status = int(spec["status"])
        # x-should-retry: false stops the SDK from retrying on its own: its retries would consume
        # the scripted failures invisibly (and honour retry-after inside create()). Callers that
        # want retries set max_retries and handle them, so every scripted error reaches the caller.
        headers = {"x-should-retry": "false"}
        if spec.get("retry_after") is not None:
            headers["retry-after"] = str(spec["retry_after"])
        raise InjectedError(
            ApiError(
                status,
                spec.get("type") or ERROR_TYPE_BY_STATUS.get(status, "api_error"),
                spec.get("message") or f"Injected error {status}",
                headers,
            )
        )
