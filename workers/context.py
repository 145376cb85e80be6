"""Which tool call is running, for a tool that wants to log or tag its effect with it, or to check
that it still owns the call just before an effect that must not happen twice."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from agentpool.store.errors import AgentPoolError


class CallNotOwned(AgentPoolError):
    """This attempt of a tool call must not take effect any more: its turn gave up on it (it timed
    out), another worker took the run over, or the run left ``running`` (cancelled)."""


@dataclass(frozen=True)
class ToolCall:
    run_id: str
    turn: int
    tool_use_id: str
    idempotency_key: str
    attempt: int
    # Set by the worker: None while this attempt owns the call, else why not (agentpool.runtime.toolcall).
    owner_check: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)

    def still_owned(self) -> bool:
        """True while this attempt may still take effect: its turn has not given up on it and its
        worker still holds the run's lease, with the run running. One fenced read in Redis; an
        answer Redis cannot give counts as False. Call it just before an effect that must not happen
        twice: a worker frozen past its lease (a GC pause, SIGSTOP, a partition) wakes up inside the
        tool, and this is how the tool learns that another worker has taken the call over."""
        return self._why_not_owned() is None

    def ensure_owned(self) -> None:
        """Raise ``CallNotOwned`` (with the reason) unless ``still_owned()``."""
        reason = self._why_not_owned()
        if reason is not None:
            raise CallNotOwned(f"tool call {self.tool_use_id} of run {self.run_id}: {reason}")

    def _why_not_owned(self) -> str | None:
        return self.owner_check() if self.owner_check is not None else None


_current: ContextVar[ToolCall | None] = ContextVar("agentpool_tool_call", default=None)


def current_call() -> ToolCall | None:
    """The call being executed, inside a tool (or its verify hook); None elsewhere."""
    return _current.get()


def set_current_call(call: ToolCall | None) -> None:
    _current.set(call)
