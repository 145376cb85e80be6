"""Running one tool call, or an unsafe tool's verify hook: in a thread bounded by the tool's timeout,
with whatever it returns or raises turned into an outcome that can always be recorded.

A Python thread cannot be killed: one that outlives its timeout is abandoned and runs on until it
returns or its process ends. ``abandoned_threads()`` counts those still running, so a process running
many turns can recycle itself (``agentpool.worker.threaded``); a forking worker's work horse takes them
with it when its turn ends. The ``Ownership`` of an abandoned call answers "no" from then on, so a
tool that calls ``ToolCall.ensure_owned()`` before its effect does not take effect late.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from redis import Redis
from redis.exceptions import RedisError

from agentpool.context import ToolCall, set_current_call
from agentpool.store.codec import safe_text
from agentpool.store.keys import RunKeys
from agentpool.store.lease import why_not_owner
from agentpool.store.ledger import Outcome
from agentpool.tools import Tool, VerifyResult

log = logging.getLogger("agentpool.tools")


class _Abandoned:
    """Threads of tool calls (and verify hooks) this process gave up on after their timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def add(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads.add(thread)

    def alive(self) -> int:
        with self._lock:
            self._threads = {t for t in self._threads if t.is_alive()}
            return len(self._threads)


_abandoned = _Abandoned()


def abandoned_threads() -> int:
    """How many tool and verify threads this process abandoned after their timeout are still running
    (spinning, or holding sockets and memory): only the end of the process frees them."""
    return _abandoned.alive()


class Ownership:
    """Answers ``ToolCall.still_owned()`` for one attempt of a call: None while it may take effect,
    else why not. It may not once its turn gave up on it (a timeout: the turn went on without it), or
    once its worker no longer holds the run's lease on a running run (checked in Redis, fenced)."""

    def __init__(self, r: Redis, keys: RunKeys, token: str) -> None:
        self.r, self.keys, self.token = r, keys, token
        self._abandoned = threading.Event()

    def abandon(self) -> None:
        self._abandoned.set()

    def __call__(self) -> str | None:
        if self._abandoned.is_set():
            return "it outlived its timeout and its turn went on without it"
        try:
            return why_not_owner(self.r, self.keys, self.token)
        except RedisError as exc:
            return f"Redis could not confirm that this worker still owns the call ({type(exc).__name__})"


Finished = tuple[Literal["value", "error", "timeout"], Any]


def call_in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], *, call: ToolCall, timeout: float) -> Finished:
    """``fn(**kwargs)`` in a daemon thread with ``call`` as its ``current_call()``; ("value", result),
    ("error", exception) or ("timeout", None), after which the thread is abandoned."""
    box: dict[str, Any] = {}
    context = contextvars.copy_context()
    context.run(set_current_call, call)

    def target() -> None:
        try:
            box["value"] = context.run(fn, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - even a SystemExit in a tool is the tool's failure, not ours
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        _abandoned.add(thread)
        return "timeout", None
    if "error" in box:
        return "error", box["error"]
    return "value", box.get("value")


def describe(exc: BaseException) -> str:
    """``Type: text`` of an exception, whatever its ``__str__`` does."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not break the turn
        text = "(its message could not be read)"
    return f"{type(exc).__name__}: {text}"


def result_text(value: Any) -> Outcome:
    """A tool's return value as the text the model gets (not yet cut to size: see ``bounded``)."""
    if value is None:
        return Outcome("", False)
    if isinstance(value, str):
        return Outcome(value, False)
    try:
        return Outcome(json.dumps(value, ensure_ascii=False), False)
    except Exception as exc:  # noqa: BLE001 - TypeError, ValueError, RecursionError: all the tool's doing
        return Outcome(
            f"the tool returned a {type(value).__name__}, which cannot be sent to the model: {describe(exc)}", True
        )


def bounded(outcome: Outcome, limit: int) -> Outcome:
    """Every outcome on its way into a record, error texts included: lone surrogates replaced (they
    cannot be encoded, so the turn could never be saved) and cut to the agent's ``max_result_chars``."""
    text = safe_text(outcome.content)
    if len(text) > limit:
        text = text[:limit] + f"\n[... cut: the result was {len(text)} characters, the limit is {limit}]"
    return outcome if text is outcome.content else replace(outcome, content=text)


def run_tool(
    tool: Tool,
    kwargs: dict[str, Any],
    *,
    call: ToolCall,
    timeout: float,
    where: str,
    ownership: Ownership | None = None,
) -> Outcome:
    """The tool's outcome: its result, or an ``is_error`` one if it raised or outlived ``timeout``."""
    if tool.takes_key:
        kwargs = {**kwargs, "idempotency_key": call.idempotency_key}
    kind, value = call_in_thread(tool.fn, kwargs, call=call, timeout=timeout)
    if kind == "timeout":
        if ownership is not None:  # None outside a worker (agentpool.testing.tool_result): nobody to tell
            ownership.abandon()
        log.warning("%s: tool %s timed out after %ss", where, tool.name, timeout)
        return Outcome(
            f"{tool.name} timed out after {timeout:g} s and was abandoned; whether it took effect is unknown.", True
        )
    if kind == "error":
        log.warning("%s: tool %s raised %s", where, tool.name, type(value).__name__)
        return Outcome(f"{tool.name} failed: {describe(value)}", True)
    return result_text(value)


def run_verify(
    tool: Tool,
    kwargs: dict[str, Any],
    *,
    call: ToolCall,
    timeout: float,
    where: str,
    ownership: Ownership | None = None,
) -> VerifyResult:
    """Ask an unsafe tool's verify hook, bounded by the tool's own timeout (a hung hook must not hold the
    run's lease for ever). A hook that raises or does not answer in time cannot tell: None."""
    assert tool.verify_fn is not None
    kind, value = call_in_thread(
        tool.verify_fn, {**kwargs, "idempotency_key": call.idempotency_key}, call=call, timeout=timeout
    )
    if kind == "timeout":
        if ownership is not None:  # None outside a worker (agentpool.testing.tool_result): nobody to tell
            ownership.abandon()
        log.warning(
            "%s: verify hook of %s gave no answer within %ss; the outcome is unknown", where, tool.name, timeout
        )
        return None
    if kind == "error":
        log.warning("%s: verify hook of %s raised %s; the outcome is unknown", where, tool.name, type(value).__name__)
        return None
    return value  # type: ignore[no-any-return]
