"""Changes to the reaper's watch set (``ap:runs:watch``) made outside a run's own writes.

The reaper reads a run, decides, then changes the watch set; a person (approve, resume) or a worker
may change the run in between. Each change here is therefore a script that re-checks, inside Redis,
the state it was decided from (``store/lua/watch_update.lua``): a run that a person resumed is never
dropped because the reaper read it ``stopped`` a moment before, nor a run whose approval was decided
because the reaper read the approvals before the decision.
"""

from __future__ import annotations

from redis import Redis

from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.store.scripts import run_script


def _update(r: Redis, run_id: str, op: str, score: int, condition: str) -> bool:
    keys = RunKeys.of(run_id)
    return bool(run_script("watch_update", r, [keys.run, RUNS_WATCH, keys.approvals], [run_id, op, score, condition]))


def reschedule_active(r: Redis, run_id: str, at_ms: int) -> bool:
    """Look at the run again at ``at_ms``, if it is still queued or running."""
    return _update(r, run_id, "add", at_ms, "active")


def forget_inactive(r: Redis, run_id: str) -> bool:
    """Drop the run from the watch set, if it is still gone or in a status nobody watches."""
    return _update(r, run_id, "rem", 0, "inactive")


def reschedule_approval(r: Redis, run_id: str, at_ms: int, *, records_seen: int) -> bool:
    """Look at a run waiting for a person again at its next deadline, if it still waits with exactly
    the ``records_seen`` approval records the decision was made from."""
    return _update(r, run_id, "add", at_ms, f"approvals:{records_seen}")


def forget_approval(r: Redis, run_id: str, *, records_seen: int) -> bool:
    """Stop watching a run that waits for a person with no deadline, under the same condition."""
    return _update(r, run_id, "rem", 0, f"approvals:{records_seen}")


def reschedule_children(r: Redis, run_id: str, at_ms: int) -> bool:
    """Look at a run waiting for its children again at ``at_ms``, if it still waits (the last child's
    end makes it due at once, and must not be pushed back by a reaper that read it a moment before)."""
    return _update(r, run_id, "add", at_ms, "children")
