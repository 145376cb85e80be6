"""The Python API apps use: enqueue a run, read it, wait for it, cancel it."""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from redis import Redis

from store import checkpoint
from store.errors import AgentPoolError
from store.events import emit
from store.records import ACTIVE_STATUSES, RunState
from workers.agent import check_agent_path
from workers.jobs import stage_turn
from workers.settings import connect


class RunTimeout(AgentPoolError):
    pass


@dataclass
class Run:
    """A run as an app sees it. ``messages`` is the conversation exactly as it would be sent."""

    id: str
    agent: str
    status: str
    turns: int
    messages: list[dict[str, Any]]
    pending: list[dict[str, Any]]
    usage: dict[str, int]
    result: str | None
    error: str | None
    created_at: float
    updated_at: float
    limits: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_state(cls, state: RunState) -> Run:
        return cls(
            id=state.id,
            agent=state.agent,
            status=state.status,
            turns=state.turns,
            messages=state.messages,
            pending=[{k: call[k] for k in ("id", "name", "input")} for call in state.pending],
            usage=dict(state.usage),
            result=state.result or None,
            error=state.error or None,
            created_at=state.created_at,
            updated_at=state.updated_at,
            limits=dict(state.limits),
        )

    @property
    def total_tokens(self) -> int:
        return sum(self.usage.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_run_id() -> str:
    """Sortable by creation, safe in URLs and RQ job ids (letters, digits, ``_`` and ``-``)."""
    return f"r_{int(time.time() * 1000):012x}{secrets.token_hex(5)}"


def enqueue_run(
    agent: str,
    task: str,
    *,
    connection: Redis | None = None,
    max_turns: int | None = None,
    run_id: str | None = None,
) -> str:
    """Create a run of ``agent`` (an import path ``module:attribute``) on ``task`` and queue its
    first turn, atomically. Returns the run id. ``max_turns`` overrides the agent's limit."""
    check_agent_path(agent)
    if not isinstance(task, str) or not task.strip():
        raise ValueError("a run needs a non-empty task text")
    if max_turns is not None and max_turns < 1:
        raise ValueError("max_turns must be positive")
    r = connection or connect()
    run_id = run_id or new_run_id()
    limits = {"max_turns": max_turns} if max_turns else {}
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()  # RQ's enqueue joins this transaction; our commands go first
        checkpoint.stage_create(pipe, run_id, agent=agent, task=task, limits=limits, now=time.time())
        stage_turn(pipe, r, run_id, 0)
        pipe.execute()
    emit(r, run_id, "status", status="queued", agent=agent)
    return run_id


def get_run(run_id: str, *, connection: Redis | None = None) -> Run:
    return Run.from_state(checkpoint.load_run(connection or connect(), run_id))


def wait_for_run(run_id: str, *, timeout: float = 300.0, connection: Redis | None = None, poll: float = 0.2) -> Run:
    """Block until the run is no longer queued or running; raise RunTimeout after ``timeout`` s."""
    r = connection or connect()
    deadline = time.monotonic() + timeout
    while True:
        state = checkpoint.load_run(r, run_id, with_messages=False)
        if state.status not in ACTIVE_STATUSES:
            return get_run(run_id, connection=r)
        if time.monotonic() >= deadline:
            raise RunTimeout(f"run {run_id} still {state.status} after {timeout:g} s (turn {state.turns})")
        time.sleep(poll)


def cancel_run(run_id: str, *, connection: Redis | None = None, reason: str = "cancelled by request") -> str:
    """End a run for good. A turn in flight notices at its next write and commits nothing further.
    Returns the status the run had before."""
    r = connection or connect()
    before = checkpoint.set_status_unfenced(r, run_id, "cancelled", error=reason)
    if before not in ("completed", "failed", "cancelled"):
        emit(r, run_id, "status", status="cancelled", error=reason)
    return before


def list_runs(
    *, connection: Redis | None = None, limit: int = 100, status: str | None = None, agent: str | None = None
) -> list[Run]:
    """Newest first, headers only (``messages`` left empty)."""
    r = connection or connect()
    runs = []
    for run_id in checkpoint.list_run_ids(r, limit=limit if not (status or agent) else limit * 20):
        try:
            state = checkpoint.load_run(r, run_id, with_messages=False)
        except AgentPoolError:
            continue
        if (status and state.status != status) or (agent and state.agent != agent):
            continue
        runs.append(Run.from_state(state))
        if len(runs) >= limit:
            break
    return runs
