"""Putting a run's current turn back on the queue when the worker that held it is gone, or gave it back.

The turn goes to the front of the queue (RQ's ``at_front``): it had already waited its turn once.

Used by the worker when its work horse dies (at once), by the reaper when a lease expired, a
committed turn's job vanished, or a hand-back's backoff ended. It re-checks everything inside one
WATCH/MULTI: a run whose lease is held, that is not active, or whose turn moved on is left alone. A
duplicate job is harmless anyway (it finds the lease held or its turn stale and exits), but we avoid
making one.

Every takeover path reads header fields a crash, a bug or a person may have damaged. A field that does
not parse fails that run with the reason (its data left as found) and never raises into the worker
that called: a forking worker's horse-death handler, the supervisor of a threaded worker and the reaper
must all go on serving other runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job

from agentpool.runtime import tracing
from agentpool.runtime.jobs import carried_call, stage_turn
from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.runtime.settings import Settings
from agentpool.store import ledger, writes
from agentpool.store.checkpoint import QUEUED_RECHECK_MS, fail_unfenced
from agentpool.store.clock import now_ms
from agentpool.store.errors import UnreadableRecord
from agentpool.store.events import emit
from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.store.lease import release_dead_holder
from agentpool.store.records import ACTIVE_STATUSES, SCHEMA_VERSION, STATUSES

log = logging.getLogger("agentpool.takeover")

# A turn started this many times without finishing is failing for a reason retrying will not fix
# (a tool that OOM-kills every worker, say): the run fails instead of taking the pool down in a loop.
# Hand-backs (a worker that cannot do the turn, on purpose) are not attempts and do not count.
MAX_TURN_ATTEMPTS = 25
HEADER_FIELDS = ("v", "status", "turns", "phase", "attempt", "job", "requeues", writes.OTHERS)


@dataclass(frozen=True)
class Header:
    """The header fields a re-enqueue decides from, parsed; ``parse`` raises UnreadableRecord."""

    version: int
    status: str
    turn: int  # the current turn (see RunState.current_turn)
    attempt: int
    requeues: int
    job: str
    writes: bytes | None
    phase: str = ""  # model: the turn's reply is not saved yet (its model call is still to make)

    @classmethod
    def parse(cls, raw: list[bytes | None]) -> Header | None:
        """None for a run that does not exist."""
        fields = dict(zip(HEADER_FIELDS, raw))
        if fields["status"] is None:
            return None

        def number(name: str) -> int:
            try:
                return int(fields[name] or 0)
            except ValueError:
                raise UnreadableRecord(f"header field {name!r} is unreadable: {fields[name][:40]!r}") from None

        def text(name: str) -> str:
            try:
                return (fields[name] or b"").decode()
            except UnicodeDecodeError:
                raise UnreadableRecord(f"header field {name!r} is not UTF-8: {fields[name][:40]!r}") from None

        version = number("v")
        if version > SCHEMA_VERSION:
            # A newer agentpool wrote it: fields this code does not know (a new status, say) are not
            # damage. Nothing here decides for it: callers leave such a run alone.
            lenient = {name: (fields[name] or b"").decode("utf-8", errors="replace") for name in ("status", "job")}
            return cls(version, lenient["status"], 0, 0, 0, lenient["job"], fields[writes.OTHERS])
        status = text("status")
        if status not in STATUSES:
            raise UnreadableRecord(f"header field 'status' holds an unknown status {status[:40]!r}")
        return cls(
            version=version,
            status=status,
            turn=number("turns") - (1 if fields["phase"] == b"tools" else 0),
            attempt=number("attempt"),
            requeues=number("requeues"),
            job=text("job"),
            writes=fields[writes.OTHERS],
            phase=text("phase"),
        )


def read_header(pipe: Redis | Pipeline, run_id: str) -> Header | None:
    return Header.parse(pipe.hmget(RunKeys.of(run_id).run, list(HEADER_FIELDS)))


def fail_corrupt(r: Redis, run_id: str, exc: UnreadableRecord, where: str) -> None:
    """The run cannot be taken over because its header is damaged: fail it with the reason, once."""
    reason = f"{exc}; the run cannot be taken over ({where}); its data is left as found"
    if _fail(r, run_id, reason):
        log.error("run %s failed: %s", run_id, reason)


def _fail(r: Redis, run_id: str, reason: str) -> bool:
    """Fail the run without its lease, with its retention and the status event; True if failed now."""
    settings = Settings.from_env()
    failed = fail_unfenced(r, run_id, reason, retention_s=settings.retention, pool_webhook=settings.pool_webhook)
    if failed:
        emit(r, run_id, "status", status="failed", error=reason)
    return failed


def stage_restart(
    pipe: Pipeline,
    r: Redis,
    run_id: str,
    *,
    turn: int,
    attempt: int,
    requeues: int,
    fields: dict | None = None,
    at_front: bool = False,
    call: tuple[str, int, int] | None = None,
) -> str:
    """In a transaction (in MULTI): give the run's current turn a new job, with ``fields`` (a new
    status, say) written to the header in the same step. ``requeues`` is the header's count of
    re-enqueues so far: the job is named by the next one, so every re-enqueue (a takeover, a resume, a
    decision, a hand-back's retry) has an id of its own and never inherits an older job's expiry.
    ``at_front``: the job goes ahead of every turn waiting. ``call``: the model call the turn is to make
    first, for its lease to reserve (``jobs.turn_job``)."""
    pipe.hset(
        RunKeys.of(run_id).run,
        mapping={"attempt": attempt, "requeues": requeues + 1, "updated_at": now_ms(), **(fields or {})},
    )
    pipe.zadd(RUNS_WATCH, {run_id: now_ms() + QUEUED_RECHECK_MS})
    return stage_turn(pipe, r, run_id, turn, requeues + 1, at_front=at_front, call=call)


def requeue_turn(
    r: Redis,
    run_id: str,
    *,
    cause: str,
    cause_kind: str,
    dead_job: str | None = None,
    count_attempt: bool = True,
    call: Any = None,
) -> str | None:
    """Enqueue the current turn again. Returns the new job id, or None when nothing was needed.

    ``call``: the model call the dead job's meta carried (``jobs.carried_call``): the new job carries
    it too if the turn has not saved its reply yet (its call is still to make), so that the lease of
    the attempt that takes over reserves it, as the first attempt's did, not a script of its own.

    ``cause_kind`` labels the takeover for metrics: horse_death, lease_expiry or job_lost; or
    ``handed_back`` (with ``count_attempt=False``), which is no takeover and counts no attempt.

    With ``dead_job``, only if that job is still the run's current one (a horse that died after
    save point B had already queued the next turn, which needs nothing). A run whose header is
    damaged is failed with the reason; this never raises for it.
    """
    keys = RunKeys.of(run_id)

    def attempt(pipe: Pipeline, write_id: str) -> tuple[Header, str, float | None] | None:
        """The header read, the new job's id and when it was queued; None when nothing was enqueued."""
        try:
            header = read_header(pipe, run_id)
        except UnreadableRecord as exc:
            pipe.unwatch()
            fail_corrupt(r, run_id, exc, f"after: {cause}")
            return None
        if header is not None and writes.landed(header.writes, write_id):
            pipe.unwatch()
            return header, header.job, None  # an earlier try's EXEC landed; its reply was lost
        moved_on = header is not None and dead_job is not None and header.job != dead_job
        if header is None or header.status not in ACTIVE_STATUSES or moved_on or pipe.exists(keys.lease):
            pipe.unwatch()
            return None
        if header.version > SCHEMA_VERSION:
            pipe.unwatch()
            return None  # a newer agentpool owns this run; an old reaper must not spin on it
        next_attempt = header.attempt + 1 if count_attempt else header.attempt
        if next_attempt > MAX_TURN_ATTEMPTS:
            pipe.unwatch()
            reason = (
                f"turn {header.turn} was started {MAX_TURN_ATTEMPTS} times without finishing (last: {cause}); "
                "check the worker logs for what kills it"
            )
            _fail(r, run_id, reason)
            return None
        pipe.multi()
        # At the front of the queue: this turn was already running (its worker died) or was handed back,
        # so it waited its place in the queue once; behind a backlog, a crash would cost the run the
        # whole queue's length instead of the takeover's few seconds.
        jid = stage_restart(
            pipe,
            r,
            run_id,
            turn=header.turn,
            attempt=next_attempt,
            requeues=header.requeues,
            at_front=True,
            call=call if header.phase == "model" else None,
        )
        writes.stage_remember(pipe, keys.run, write_id)
        queued_at = time.time()  # no later than the job is on the queue, for another worker to take
        pipe.execute()
        return header, jid, queued_at

    requeued = writes.watched(r, [keys.run, keys.lease], attempt)
    if requeued is None:
        return None
    header, jid, queued_at = requeued
    queued = None if queued_at is None else round(queued_at, 3)
    if count_attempt:
        log.warning("run %s: turn %s re-enqueued as %s (%s)", run_id, header.turn, jid, cause)
        emit(r, run_id, "takeover", turn=header.turn, cause=cause, cause_kind=cause_kind, job=jid, queued_at=queued)
        tracing.record_takeover(r, run_id, header.turn, cause, cause_kind, jid)
    else:
        log.info("run %s: turn %s re-enqueued as %s (%s)", run_id, header.turn, jid, cause)
        emit(r, run_id, "requeued", turn=header.turn, cause=cause, job=jid)
    if dead_job and cause_kind == "lease_expiry":
        # Its worker is gone (or frozen past the lease: fenced out either way). A job that failed for a
        # reason of its own (job_lost) is kept: its traceback is worth reading.
        forget_turn_job(r, dead_job)
    return jid


def turn_of(job: Job) -> tuple[str, int] | None:
    """The run id and turn of an agentpool turn job (its args); None for any other job."""
    try:
        args = job.args
    except (DeserializationError, ValueError, TypeError):
        return None
    if not isinstance(args, (list, tuple)) or len(args) != 2:
        return None
    run_id, turn = args[0], args[1]
    if not isinstance(run_id, str) or not isinstance(turn, int) or isinstance(turn, bool):
        return None
    return run_id, turn


def is_turn_job(job: Job) -> bool:
    return turn_of(job) is not None


def forget_turn_job(r: Redis, job_id: str) -> None:
    """Delete the RQ job of a turn that was handed over (its run's turn is queued again under a new job
    id), with its registry entries: otherwise ``rq info`` shows it started for minutes, then RQ's cleanup
    counts it ``failed`` although the run goes on. Best effort: it is bookkeeping, not the run's state."""
    try:
        job = Job.fetch(job_id, connection=r, serializer=MsgpackSerializer)
        # A turn job's executions are in no per-job index (agentpool.worker.lean): its entry in the
        # started registry is found by its id. Rare (a takeover), so a scan of the registry is affordable.
        registry = job.started_job_registry
        stale = list(r.zscan_iter(registry.key, match=f"{job_id}:*", count=500))
        job.delete()
        if stale:
            r.zrem(registry.key, *(member for member, _score in stale))
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
    turn = turn_of(job)
    if turn is None:
        return None  # not an agentpool turn
    run_id = turn[0]
    if not isinstance(run_id, str):
        return None
    ledger.mark_ended(r, RunKeys.of(run_id), holder, now_ms() / 1000)
    release_dead_holder(r, RunKeys.of(run_id), holder)
    requeued = requeue_turn(r, run_id, cause=cause, cause_kind="horse_death", dead_job=job.id, call=carried_call(job))
    return run_id if requeued else None
