"""Which tool call is running, for a tool that wants to log or tag its effect with it."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    run_id: str
    turn: int
    tool_use_id: str
    idempotency_key: str
    attempt: int


_current: ContextVar[ToolCall | None] = ContextVar("agentpool_tool_call", default=None)


def current_call() -> ToolCall | None:
    """The call being executed, inside a tool; None elsewhere."""
    return _current.get()


def set_current_call(call: ToolCall | None) -> None:
    _current.set(call)
