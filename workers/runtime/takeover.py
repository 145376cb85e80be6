"""Putting a run's current turn back on the queue when the worker that held it is gone.

Used by the worker when its work horse dies (at once) and by the reaper when a lease expired or a
committed turn's job vanished. It re-checks everything inside one WATCH/MULTI: a run whose lease is
held, that is not active, or whose turn moved on is left alone. A duplicate job is harmless anyway
(it finds the lease held or its turn stale and exits), but we avoid making one.
"""

from __future__ import annotations

import logging

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError, WatchError
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job

from agentpool.runtime.jobs import stage_turn
from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.store import ledger
from agentpool.store.checkpoint import QUEUED_RECHECK_MS, fail_unfenced
from agentpool.store.clock import now_ms
from agentpool.store.events import emit
from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.store.lease import release_dead_holder
from agentpool.store.records import ACTIVE_STATUSES, SCHEMA_VERSION

log = logging.getLogger("agentpool.takeover")

# A turn started this many times without finishing is failing for a reason retrying will not fix
# (a tool that OOM-kills every worker, say): the run fails instead of taking the pool down in a loop.
MAX_TURN_ATTEMPTS = 25


def stage_restart(pipe: Pipeline, r: Redis, run_id: str, *, turn: int, attempt: int, fields: dict | None = None) -> str:
    """In a transaction (in MULTI): give the run's current turn a new job, with ``fields`` (a new
    status, say) written to the header in the same step."""
    pipe.hset(RunKeys.of(run_id).run, mapping={"attempt": attempt, "updated_at": now_ms(), **(fields or {})})
    pipe.zadd(RUNS_WATCH, {run_id: now_ms() + QUEUED_RECHECK_MS})
    return stage_turn(pipe, r, run_id, turn, attempt)


def current_turn(turns: bytes | None, phase: bytes | None) -> int:
    return int(turns or 0) - (1 if phase == b"tools" else 0)


def requeue_turn(r: Redis, run_id: str, *, cause: str, cause_kind: str, dead_job: str | None = None) -> str | None:
    """Enqueue the current turn again. Returns the new job id, or None when nothing was needed.

    ``cause_kind`` labels the takeover for metrics: horse_death, lease_expiry or job_lost.

    With ``dead_job``, only if that job is still the run's current one (a horse that died after
    save point B had already queued the next turn, which needs nothing).
    """
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.run, keys.lease)
                v, status, turns, phase, attempt, job = pipe.hmget(
                    keys.run, ["v", "status", "turns", "phase", "attempt", "job"]
                )
                moved_on = dead_job is not None and (job or b"").decode() != dead_job
                if status is None or status.decode() not in ACTIVE_STATUSES or moved_on or pipe.exists(keys.lease):
                    pipe.unwatch()
                    return None
                if int(v or 0) > SCHEMA_VERSION:
                    pipe.unwatch()
                    return None  # a newer agentpool owns this run; an old reaper must not spin on it
                turn = current_turn(turns, phase)
                next_attempt = int(attempt or 0) + 1
                if next_attempt > MAX_TURN_ATTEMPTS:
                    pipe.unwatch()
                    fail_unfenced(
                        r,
                        run_id,
                        f"turn {turn} was started {MAX_TURN_ATTEMPTS} times without finishing (last: {cause}); "
                        "check the worker logs for what kills it",
                    )
                    return None
                pipe.multi()
                jid = stage_restart(pipe, r, run_id, turn=turn, attempt=next_attempt)
                pipe.execute()
            except WatchError:
                continue
            log.warning("run %s: turn %s re-enqueued as %s (%s)", run_id, turn, jid, cause)
            emit(r, run_id, "takeover", turn=turn, cause=cause, cause_kind=cause_kind, job=jid)
            if dead_job and cause_kind == "lease_expiry":
                # Its worker is gone (or frozen past the lease: fenced out either way). A job that failed
                # for a reason of its own (job_lost) is kept: its traceback is worth reading.
                forget_turn_job(r, dead_job)
            return jid


def is_turn_job(job: Job) -> bool:
    try:
        _run_id, _turn = job.args
    except (DeserializationError, ValueError, TypeError):
        return False
    return True


def forget_turn_job(r: Redis, job_id: str) -> None:
    """Delete the RQ job of a turn that was handed over (its run's turn is queued again under a new job
    id), with its registry entries: otherwise ``rq info`` shows it started for minutes, then RQ's cleanup
    counts it ``failed`` although the run goes on. Best effort: it is bookkeeping, not the run's state."""
    try:
        Job.fetch(job_id, connection=r, serializer=MsgpackSerializer).delete()
    except NoSuchJobError:
        pass
    except RedisError as exc:
        log.warning("could not delete handed-over job %s: %s", job_id, exc)


def hand_over_dead_holder(r: Redis, job: Job, holder: str, *, cause: str) -> str | None:
    """The process ``holder`` (``<worker name>.<pid>``) that ran ``job`` is known dead, and every
    process it started is gone (the caller ended its process group): record that the calls it left
    without an outcome can no longer take effect (reconcile then need not wait out their timeout),
    drop its lease on the job's run and re-enqueue the turn at once, without waiting for the lease to
    expire. Returns the run id re-enqueued, or None (not an agentpool turn, or nothing was needed)."""
    try:
        run_id, _turn = job.args
    except (DeserializationError, ValueError, TypeError):
        return None  # not an agentpool turn
    ledger.mark_ended(r, RunKeys.of(run_id), holder, now_ms() / 1000)
    release_dead_holder(r, RunKeys.of(run_id), holder)
    return run_id if requeue_turn(r, run_id, cause=cause, cause_kind="horse_death", dead_job=job.id) else None
