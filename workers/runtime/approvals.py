"""Human approval of tool calls: the decision (``agentpool.approve`` calls ``decide``), and expiry for the reaper.

A tool declared ``requires_approval=True`` pauses its run (``waiting_approval``) before its intent is
written. Nothing is queued or leased while the run waits. Once every call it waits on is decided
(approved, denied, or expired), the run's turn is queued again and the turn runs or refuses each call.
"""

from __future__ import annotations

import time

from redis import Redis
from redis.client import Pipeline

from agentpool.checks import EXPIRY
from agentpool.runtime.takeover import read_header, stage_restart
from agentpool.store import approvals, watch, writes
from agentpool.store.errors import AgentPoolError, RunNotFound
from agentpool.store.events import emit
from agentpool.store.keys import RunKeys


class ApprovalError(AgentPoolError):
    """A decision that cannot be taken: the run is not waiting, or not on that tool_use."""


def decide(r: Redis, run_id: str, tool_use_ids: list[str] | None, *, approved: bool, reason: str, by: str) -> list[str]:
    """Record the decision on ``tool_use_ids`` (every call awaiting one if None) and, once no call
    awaits one any more, queue the run's turn. Safe to deliver twice: after a lost EXEC reply it finds
    its write id and returns what it decided, instead of "the run is not waiting"."""
    keys = RunKeys.of(run_id)

    def attempt(pipe: Pipeline, write_id: str) -> tuple[list[str], dict[str, approvals.Wait] | None, bool]:
        """The decided calls, their waits (None when an earlier try had landed: its reply was lost, and
        with it the events), and whether the run goes on now."""
        header = read_header(pipe, run_id)
        if header is None:
            raise RunNotFound(run_id)
        done = writes.landed(header.writes, write_id)
        if done is not None:
            pipe.unwatch()
            return done.split(","), None, False
        waits, decisions = approvals.read(pipe, keys)  # type: ignore[arg-type]
        if header.status != "waiting_approval":
            raise ApprovalError(
                f"run {run_id} is {header.status}, not waiting for approval{_decided(decisions, tool_use_ids)}"
            )
        awaiting = [i for i in waits if i not in decisions]
        targets = awaiting if tool_use_ids is None else tool_use_ids
        unknown = [i for i in targets if i not in awaiting]
        if unknown or not targets:
            raise ApprovalError(
                f"run {run_id} is not waiting for a decision on {', '.join(unknown) or 'anything'}; "
                f"it waits on: {', '.join(awaiting) or 'nothing'}{_decided(decisions, unknown)}"
            )
        now = time.time()
        pipe.multi()
        for tool_use_id in targets:
            pipe.hset(
                keys.approvals,
                tool_use_id,
                approvals.decision_record(waits[tool_use_id], approved=approved, reason=reason, now=now, by=by),
            )
        goes_on = set(targets) == set(awaiting)
        if goes_on:
            stage_restart(
                pipe,
                r,
                run_id,
                turn=header.turn,
                attempt=header.attempt,  # a person's decision is not a crash
                requeues=header.requeues,
                fields={"status": "running", "error": ""},
            )
        writes.stage_remember(pipe, keys.run, write_id, ",".join(targets))
        pipe.execute()
        return targets, waits, goes_on

    targets, waits, goes_on = writes.watched(r, [keys.run, keys.approvals], attempt)
    if waits is None:
        return targets
    for tool_use_id in targets:
        emit(r, run_id, "approval", tool_use_id=tool_use_id, tool=waits[tool_use_id].name, approved=approved, by=by)
    if goes_on:
        emit(r, run_id, "status", status="running", reason="decisions taken")
    return targets


def _decided(decisions: dict[str, approvals.Decision], tool_use_ids: list[str] | None) -> str:
    """What became of calls a decision came too late for (the expiry denied one first, say)."""
    said = []
    for tool_use_id in tool_use_ids or []:
        decision = decisions.get(tool_use_id)
        if decision is not None:
            verdict = "approved" if decision.approved else "denied"
            who = "automatically: its approval expired" if decision.by == EXPIRY else f"by {decision.by}"
            said.append(f"{tool_use_id} was {verdict} already, {who}")
    return f" ({'; '.join(said)})" if said else ""


def expire_due(r: Redis, run_id: str) -> list[str]:
    """Deny the calls whose approval deadline passed (the reaper calls this for waiting runs), or
    reschedule the run for its next deadline. Returns the tool_use ids denied.

    The denial is a watched transaction (``decide``); rescheduling or dropping the run from the watch
    set happens only if the run still waits with the approval records read here (a person deciding
    meanwhile queues its turn and keeps it watched: see ``agentpool.store.watch``)."""
    keys = RunKeys.of(run_id)
    records_seen = r.hlen(keys.approvals)
    waits, decisions = approvals.read(r, keys)
    if len(waits) + len(decisions) != records_seen:
        return []  # changed between the two reads: look again at the next scan
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
                by=EXPIRY,
                reason=f"no decision within {waited:.0f} s; denied automatically",
            )
        except ApprovalError:
            return []  # decided or cancelled meanwhile
    settle_watch(r, run_id, open_waits, records_seen=records_seen)
    return []


def settle_watch(r: Redis, run_id: str, open_waits: list[approvals.Wait], *, records_seen: int) -> bool:
    """The reaper's watch-set change for a waiting run, decided from ``open_waits`` as read with
    ``records_seen`` approval records: look again at the next deadline, or stop watching a run that
    waits for nobody's deadline. Applied only if the run is still in that state."""
    deadlines = [w.deadline for w in open_waits if w.deadline is not None]
    if deadlines:
        return watch.reschedule_approval(r, run_id, int(min(deadlines) * 1000), records_seen=records_seen)
    return watch.forget_approval(r, run_id, records_seen=records_seen)
