"""Which step answers a request, when a script reacts to what happened: ``branches`` chosen by ``when``
conditions on the last tool results or the task, and Python callables that build the step.

A step may be ``{"branches": [branch, ...]}``: each branch is a step with an optional ``when``; the
first branch whose ``when`` holds answers (a branch without ``when`` always does, so put it last). A
``when`` holds when all its keys do:

- ``is_error`` (bool), ``result_contains`` (str), ``result_matches`` (regex, searched) and ``tool`` (the
  name of the tool called): one tool_result of the last user message satisfies every one given;
- ``task_contains`` (str): the text of the first user message contains it.

For example, after an approval was denied::

    {"branches": [
        {"when": {"tool": "issue_credit", "is_error": True}, "text": "I could not issue the credit."},
        {"text": "Credit issued."}]}

In-process, a whole script (or one step of a list) may be a callable given a :class:`ScriptRequest` and
returning a step (``None``: the default "Done."). Selection stays a function of the request: a call
retried after a crash must get the same answer, so a callable must not count calls.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentpool.testing.scripted_model.common import invalid

WHEN_KEYS = frozenset({"is_error", "result_contains", "result_matches", "tool", "task_contains"})
RESULT_KEYS = WHEN_KEYS - {"task_contains"}


@dataclass(frozen=True)
class ToolResult:
    """One tool_result of the request's last user message, with the name of the tool that was called."""

    tool_use_id: str
    tool: str | None
    content: str
    is_error: bool


@dataclass(frozen=True)
class ScriptRequest:
    """What a script callable is given: the request as the API received it, and what tests usually
    branch on, already extracted."""

    body: dict[str, Any]
    step: int  # assistant messages so far: 0 for the first call of a run
    task: str  # the text of the first user message
    tool_results: list[ToolResult] = field(default_factory=list)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body["messages"]

    @property
    def last_result(self) -> ToolResult | None:
        return self.tool_results[-1] if self.tool_results else None

    @property
    def tools(self) -> list[str]:
        """The names of the tools the request offers."""
        return [t.get("name") for t in self.body.get("tools") or []]

    def result_of(self, tool: str) -> ToolResult | None:
        """The (last) result of a call to ``tool`` in the last user message."""
        found = [r for r in self.tool_results if r.tool == tool]
        return found[-1] if found else None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def request_of(body: dict[str, Any], step: int, task: str) -> ScriptRequest:
    messages = body["messages"]
    names: dict[str, str] = {}
    for message in messages:
        if message.get("role") == "assistant" and isinstance(message.get("content"), list):
            names.update({b["id"]: b.get("name") for b in message["content"] if b.get("type") == "tool_use"})
    last = messages[-1] if messages and messages[-1].get("role") == "user" else {}
    results = [
        ToolResult(b["tool_use_id"], names.get(b["tool_use_id"]), _text(b.get("content")), bool(b.get("is_error")))
        for b in (last.get("content") if isinstance(last.get("content"), list) else [])
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]
    return ScriptRequest(body, step, task, results)


def validate_branches(where: str, step: dict, validate_step: Callable[[str, Any], None]) -> None:
    extra = [k for k in step if k != "branches" and not k.startswith("_")]
    if extra:
        raise ValueError(f"{where}: a step with branches has no other keys (found {extra}); put them in a branch")
    branches = step["branches"]
    if not isinstance(branches, list) or not branches:
        raise ValueError(f"{where}.branches: must be a non-empty list of steps")
    for i, branch in enumerate(branches):
        if not isinstance(branch, dict):
            raise ValueError(f"{where}.branches.{i}: a branch must be an object")
        if "branches" in branch:
            raise ValueError(f"{where}.branches.{i}: branches do not nest")
        when = branch.get("when", {})
        if not isinstance(when, dict):
            raise ValueError(f"{where}.branches.{i}.when: must be an object")
        unknown = sorted(set(when) - WHEN_KEYS)
        if unknown:
            raise ValueError(f"{where}.branches.{i}.when: unknown keys {unknown}; allowed: {sorted(WHEN_KEYS)}")
        if "is_error" in when and not isinstance(when["is_error"], bool):
            raise ValueError(f"{where}.branches.{i}.when.is_error: must be true or false")
        for key in ("result_contains", "result_matches", "tool", "task_contains"):
            if key in when and not isinstance(when[key], str):
                raise ValueError(f"{where}.branches.{i}.when.{key}: must be a string")
        if "result_matches" in when:
            try:
                re.compile(when["result_matches"])
            except re.error as exc:
                raise ValueError(f"{where}.branches.{i}.when.result_matches: not a regular expression: {exc}") from None
        validate_step(f"{where}.branches.{i}", {k: v for k, v in branch.items() if k != "when"})


def _holds(when: dict, request: ScriptRequest) -> bool:
    if "task_contains" in when and when["task_contains"] not in request.task:
        return False
    wanted = {k: v for k, v in when.items() if k in RESULT_KEYS}
    if not wanted:
        return True
    return any(
        ("tool" not in wanted or result.tool == wanted["tool"])
        and ("is_error" not in wanted or result.is_error == wanted["is_error"])
        and ("result_contains" not in wanted or wanted["result_contains"] in result.content)
        and ("result_matches" not in wanted or re.search(wanted["result_matches"], result.content))
        for result in request.tool_results
    )


def resolve(
    name: str, script: Any, request: ScriptRequest, validate_step: Callable[[str, Any], None]
) -> dict[str, Any]:
    """The step that answers ``request`` from ``script`` (a list of steps, or a callable)."""
    where = f"script {name!r} step {request.step}"
    step: Any
    if callable(script):
        step = _call(script, request, where, validate_step)
    else:
        step = script[request.step] if request.step < len(script) else {}
        if callable(step):
            step = _call(step, request, where, validate_step)
    if step is None:
        step = {}
    if not isinstance(step, dict) or "branches" not in step:
        return step
    for branch in step["branches"]:
        if _holds(branch.get("when", {}), request):
            return {k: v for k, v in branch.items() if k != "when"}
    seen = [(r.tool, "error" if r.is_error else "ok", r.content[:80]) for r in request.tool_results]
    raise invalid(
        f"[scripted model] {where}: no branch's `when` matches (last tool results: {seen}); "
        "end the branches with one that has no `when`"
    )


def _call(
    fn: Callable[[ScriptRequest], Any], request: ScriptRequest, where: str, validate_step: Callable[[str, Any], None]
) -> Any:
    try:
        step = fn(request)
        if step is not None:
            validate_step(where, step)
    except Exception as exc:  # noqa: BLE001 - a test's own bug, answered as a 400 the run fails with
        raise invalid(f"[scripted model] {where}: the script function failed: {type(exc).__name__}: {exc}") from None
    return step
