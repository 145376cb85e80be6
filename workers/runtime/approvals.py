"""Human approval of tool calls: the decision (``agentpool.approve`` calls ``decide``), and expiry for the reaper.

A tool declared ``requires_approval=True`` pauses its run (``waiting_approval``) before its intent is
written. Nothing is queued or leased while the run waits. Once every call it waits on is decided
(approved, denied, or expired), the run's turn is queued again and the turn runs or refuses each call.
"""

from __future__ import annotations

import time

from redis import Redis
from redis.exceptions import WatchError

from agentpool.runtime.takeover import current_turn, stage_restart
from agentpool.store import approvals
from agentpool.store.errors import AgentPoolError, RunNotFound
from agentpool.store.events import emit
from agentpool.store.keys import RUNS_WATCH, RunKeys


class ApprovalError(AgentPoolError):
    """A decision that cannot be taken: the run is not waiting, or not on that tool_use."""


def decide(r: Redis, run_id: str, tool_use_ids: list[str] | None, *, approved: bool, reason: str, by: str) -> list[str]:
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.run, keys.approvals)
                status, turns, phase, attempt = pipe.hmget(keys.run, ["status", "turns", "phase", "attempt"])
                if status is None:
                    raise RunNotFound(run_id)
                if status != b"waiting_approval":
                    raise ApprovalError(f"run {run_id} is {status.decode()}, not waiting for approval")
                waits, decisions = approvals.read(pipe, keys)  # type: ignore[arg-type]
                awaiting = [i for i in waits if i not in decisions]
                targets = awaiting if tool_use_ids is None else tool_use_ids
                unknown = [i for i in targets if i not in awaiting]
                if unknown or not targets:
                    raise ApprovalError(
                        f"run {run_id} is not waiting for a decision on {', '.join(unknown) or 'anything'}; "
                        f"it waits on: {', '.join(awaiting) or 'nothing'}"
                    )
                now = time.time()
                pipe.multi()
                for tool_use_id in targets:
                    pipe.hset(
                        keys.approvals,
                        tool_use_id,
                        approvals.decision_record(waits[tool_use_id], approved=approved, reason=reason, now=now, by=by),
                    )
                if set(targets) == set(awaiting):
                    stage_restart(
                        pipe,
                        r,
                        run_id,
                        turn=current_turn(turns, phase),
                        attempt=int(attempt or 0) + 1,
                        fields={"status": "running", "error": ""},
                    )
                pipe.execute()
            except WatchError:
                continue
            for tool_use_id in targets:
                emit(
                    r,
                    run_id,
                    "approval",
                    tool_use_id=tool_use_id,
                    tool=waits[tool_use_id].name,
                    approved=approved,
                    by=by,
                )
            if set(targets) == set(awaiting):
                emit(r, run_id, "status", status="running", reason="decisions taken")
            return targets


def expire_due(r: Redis, run_id: str) -> list[str]:
    """Deny the calls whose approval deadline passed (the reaper calls this for waiting runs), or
    reschedule the run for its next deadline. Returns the tool_use ids denied."""
    keys = RunKeys.of(run_id)
    waits, decisions = approvals.read(r, keys)
    open_waits = [w for w in waits.values() if w.tool_use_id not in decisions]
    due = [w for w in open_waits if w.deadline is not None and w.deadline <= time.time()]
    if due:
        waited = max(time.time() - w.requested_at for w in due)
        try:
            return decide(
                r,
                run_id,
                [w.tool_use_id for w in due],
                approved=False,
                by="expiry",
                reason=f"no decision within {waited:.0f} s; denied automatically",
            )
        except ApprovalError:
            return []  # decided or cancelled meanwhile
    deadlines = [w.deadline for w in open_waits if w.deadline is not None]
    if deadlines:
        r.zadd(RUNS_WATCH, {run_id: int(min(deadlines) * 1000)})
    else:
        r.zrem(RUNS_WATCH, run_id)
    return []
