"""The reaper: finds active runs whose turn has nobody working on it and re-enqueues that turn.

It reads agentpool's own state, not RQ's registries: the watch set (run id -> when to look next,
pushed forward by every lease renewal and commit), the lease, and the job id the run's header says
carries its current turn. It repairs two things: a lease that expired (the worker died or froze), and
a committed turn whose job vanished (a flushed queue, a failover that lost the push). It re-enqueues
a turn that was handed back on purpose once its backoff ends (not a takeover: no attempt is counted).
It moves deferred turns (a model retry's backoff) onto the queue once due (``agentpool.runtime.deferred``):
that is agentpool's only scheduler. It also denies approvals whose deadline passed, which continues
the waiting run, and queues the turn of a run whose last child run ended (``agentpool.runtime.subagents``).
A run whose header is damaged is failed with the reason, once, and the scan goes on.
Each scan also takes one step of the sweep that drops expired runs from the run index
(``agentpool.store.runs_index``), and gives back to the head of its queue a turn job left in the RQ
intermediate queue of any of agentpool's queues (moved there by a BLMOVE whose worker then died, or
whose reply a silent connection swallowed) once it has been seen there for ``STRANDED_AFTER`` seconds
(by any reaper: the sighting is kept in Redis) with no execution in RQ's started registry: a worker
prepares the execution within milliseconds of its BLMOVE, and the job would otherwise wait for the
run's 30 s recheck. Giving back a job a slow worker still claims is harmless: the second execution
finds the lease held or the turn done. A claimed job whose run holds no lease is taken over at once if
its lease lapsed, and after ``CLAIM_GRACE`` seconds if it never took one (its worker claims the job and
takes the lease a round trip later: see ``store.lease.claimed_job_state``).

Every worker runs it in a thread; a one-second lock lets one of them scan at a time. Due deferred
turns are looked for without the lock (that move is atomic) by every worker, each at random moments
spread so that the pool as a whole looks about every ``PROMOTE_EVERY`` seconds, however many workers
it has: one look costs Redis one command, and ten a second for each of hundreds of idle workers would
cost it a good part of a core.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

from redis import Redis
from redis.exceptions import ConnectionError, ReadOnlyError, RedisError, TimeoutError
from rq import Queue
from rq.job import Job, JobStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from agentpool.runtime import deferred, subagents
from agentpool.runtime.approvals import expire_due
from agentpool.runtime.jobs import agentpool_queues, carried_call_of, give_back, queue_of, turn_queue
from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.runtime.settings import Settings
from agentpool.runtime.takeover import fail_corrupt, read_header, requeue_turn
from agentpool.store import handback, lease, runs_index, watch
from agentpool.store.checkpoint import QUEUED_RECHECK_MS
from agentpool.store.clock import now_ms
from agentpool.store.errors import UnreadableRecord
from agentpool.store.keys import REAPER_LOCK, RUNS_WATCH, STRANDED, RunKeys
from agentpool.store.records import ACTIVE_STATUSES, SCHEMA_VERSION
from agentpool.store.scripts import run_script

log = logging.getLogger("agentpool.reaper")
PROMOTE_EVERY = 0.1  # seconds between the pool's looks for due deferred turns (one ZRANGEBYSCORE each)
PROMOTE_AT_LEAST_EVERY = 2.0  # seconds: each worker looks at least this often, however many there are
WORKERS_COUNTED_EVERY = 10.0  # seconds between counts of the pool's workers (RQ's worker set)
STRANDED_AFTER = 10.0  # seconds a job may sit in RQ's intermediate queue before it is given back
CLAIM_GRACE = 3.0  # seconds a claimed turn job may go without ever taking its run's lease before a takeover
WAITING = {JobStatus.QUEUED.value, JobStatus.DEFERRED.value}


def reap_once(
    r: Redis,
    *,
    batch: int = 500,
    report: Callable[[str, str], None] | None = None,
    stranded_after: float = STRANDED_AFTER,
    claim_grace: float = CLAIM_GRACE,
) -> list[str]:
    """Look at every run that is due. Returns the ids of runs whose turn was re-enqueued; ``report``
    (``agentpool reap``) is told each thing done, as (run id, what). ``stranded_after`` and
    ``claim_grace``: seconds a job may sit unclaimed in an intermediate queue, and claimed without
    ever taking its run's lease, before the reaper steps in.

    Every change to the watch set is conditional on the status it was decided from (``store/watch.py``):
    a person resuming or approving a run while the reaper looks at it never drops it from the set."""
    for job_id in _give_back_stranded(r, stranded_after):
        if report:
            report("-", f"job {job_id} left in RQ's intermediate queue given back to the queue")
    for moved in _promote(r, batch=batch):
        if report:
            report(
                moved.run_id, f"deferred turn {moved.turn} enqueued as {moved.job_id} ({moved.late_ms} ms after due)"
            )
    requeued = []
    for raw in r.zrangebyscore(RUNS_WATCH, "-inf", now_ms(), start=0, num=batch):
        run_id = raw.decode("utf-8", errors="replace")
        try:
            if _reap(r, run_id, report, claim_grace):
                requeued.append(run_id)
        except (ConnectionError, TimeoutError, ReadOnlyError):
            raise  # Redis is away or failing over: the whole scan waits for it
        except Exception:
            # A bug, or a record a script cannot read (Redis answered with an error about this run's
            # data): say it once a recheck, not every scan, and go on with the other runs. Left to stop
            # the scan, it would leave every run due after this one unreaped.
            log.exception("reaper: could not check run %s", run_id)
            # Whatever it waits for: a run waiting for children or a person would stay due (and logged
            # every scan) under reschedule_active's condition. At worst this pushes back by a recheck a
            # change a person made meanwhile, in a run already in trouble.
            r.zadd(RUNS_WATCH, {run_id: now_ms() + QUEUED_RECHECK_MS}, xx=True, gt=True)
    swept = runs_index.sweep_expired(r, pass_every=_sweep_pass_every())
    if swept and report:
        report("-", f"{swept} expired run(s) dropped from the run index")
    return requeued


def _sweep_pass_every() -> float:
    """Seconds between two passes of the run index's sweep: ``SWEEP_PASS_EVERY``, or this worker's
    retention if shorter, so an entry outlives its run by no longer than the run was kept once it ended."""
    retention = Settings.from_env().retention
    return min(runs_index.SWEEP_PASS_EVERY, retention) if retention > 0 else runs_index.SWEEP_PASS_EVERY


def _give_back_stranded(r: Redis, after: float) -> list[str]:
    """Give back the turn jobs that sat in an intermediate queue (of any of agentpool's queues: the
    worker scanning may serve other queues than the dead one did) for ``after`` seconds unclaimed. When
    each was first seen there is kept in Redis, on its clock (``ap:stranded``), not in this process: the
    wait does not start again when the reaper's lock moves to another worker, and ``agentpool reap
    --once`` run twice gives a job back."""
    queues = [Queue(name, connection=r, serializer=MsgpackSerializer) for name in agentpool_queues(r)]
    if not queues:
        return []
    keys = [STRANDED, *(queue.intermediate_queue_key for queue in queues)]
    due = run_script("stranded_jobs", r, keys, [int(after * 1000), 100])
    given = []
    for i in range(0, len(due), 3):
        queue, job_id, listed_ms = queues[int(due[i]) - 1], due[i + 1].decode("utf-8", errors="replace"), due[i + 2]
        if job_id in queue.started_job_registry:
            continue  # claimed: its execution is prepared, the process it forks takes it out (as RQ's cleanup)
        if give_back(r, queue, job_id):
            r.hdel(STRANDED, job_id)  # so that it waits its full time again if it is ever stranded again
            log.warning(
                "reaper: job %s sat in RQ's intermediate queue %s for %.0f s; given back to the queue",
                job_id,
                queue.name,
                listed_ms / 1000,
            )
            given.append(job_id)
    return given


def _promote(r: Redis, batch: int = 500) -> list[deferred.Promoted]:
    moved = deferred.promote_due(r, batch=batch)
    for one in moved:
        log.info(
            "run %s: deferred turn %d enqueued as %s, %d ms after due", one.run_id, one.turn, one.job_id, one.late_ms
        )
    return moved


def _reap(
    r: Redis, run_id: str, report: Callable[[str, str], None] | None = None, claim_grace: float = CLAIM_GRACE
) -> bool:
    """True if the run's turn was re-enqueued; otherwise when to look again is recorded."""
    keys = RunKeys.of(run_id)
    try:
        header = read_header(r, run_id)
    except UnreadableRecord as exc:
        fail_corrupt(r, run_id, exc, "found by the reaper")
        return False
    if header is None:
        watch.forget_inactive(r, run_id)
        return False
    if header.version > SCHEMA_VERSION:  # a newer agentpool's run: its own reapers look after it
        r.zadd(RUNS_WATCH, {run_id: now_ms() + QUEUED_RECHECK_MS}, xx=True)  # (unless they dropped it)
        return False
    if header.status == "waiting_approval":
        denied = expire_due(r, run_id)  # due because an approval deadline passed
        if denied and report:
            report(run_id, f"denied {', '.join(denied)}: the approval expired")
        return False
    if header.status == "waiting_children":
        subagents.check_waiting(r, run_id)  # a backstop: the last child's end wakes it
        return False
    if header.status not in ACTIVE_STATUSES:
        watch.forget_inactive(r, run_id)
        return False
    ttl = r.pttl(keys.lease)
    if ttl > 0:
        watch.reschedule_active(r, run_id, now_ms() + ttl)
        return False
    if r.hget(keys.run, "wake") == b"1":  # its last child ended: its turn goes on (no takeover, no attempt)
        jid = subagents.wake(r, run_id)
        if jid and report:
            report(run_id, f"children ended; turn queued as {jid}")
        return bool(jid)
    found = _why_orphaned(r, run_id, header.job, claim_grace)
    if found is None:
        return False
    cause, cause_kind, count_attempt = found
    # The call the dead job was to make goes with the new one (if the turn's reply is not saved yet), so
    # that the lease of the attempt taking over reserves it, as a work horse's takeover does.
    call = carried_call_of(r, header.job) if header.job and header.phase == "model" else None
    jid = requeue_turn(
        r, run_id, cause=cause, cause_kind=cause_kind, dead_job=header.job, count_attempt=count_attempt, call=call
    )
    if jid:
        if report:
            report(run_id, f"re-enqueued as {jid} ({cause})")
        return True
    # Left alone on purpose (a newer schema, say): look again later, not every second.
    watch.reschedule_active(r, run_id, now_ms() + QUEUED_RECHECK_MS)
    return False


def _why_orphaned(r: Redis, run_id: str, job_id: str, claim_grace: float) -> tuple[str, str, bool] | None:
    """None if the run's turn is fine (when to look again is then recorded); else (why, kind, whether
    re-enqueueing it counts as an attempt)."""
    record = handback.read(r, RunKeys.of(run_id))
    if record is not None and record.job == job_id:
        # The turn was given back on purpose: not a crash, no attempt; re-enqueued when its backoff ends.
        if record.until * 1000 > now_ms():
            watch.reschedule_active(r, run_id, int(record.until * 1000))
            return None
        return f"handed back ({record.reason}), backoff over", "handed_back", False
    # Deferred first, then the job: the move to the queue is atomic, so a turn is always in one of them.
    due = deferred.due_for_job(r, run_id, job_id) if job_id else None
    if due is not None:  # not an RQ job until due: the scan that finds it due enqueues it
        watch.reschedule_active(r, run_id, max(due, now_ms()) + QUEUED_RECHECK_MS)
        return None
    job_state = _job_state(r, run_id, job_id) if job_id else "missing"
    if job_state == "waiting":
        watch.reschedule_active(r, run_id, now_ms() + QUEUED_RECHECK_MS)
        return None
    if job_state == "started":
        # Claimed, and either its lease lapsed or it has not taken it yet: a worker claims a job and
        # takes the lease a round trip later, and a takeover in between would count an attempt and
        # drop the live execution from the started registry (its worker's death would then wait for
        # the lease to expire instead of being seen at once).
        grace_ms = max(1, int(claim_grace * 1000))
        claim = lease.claimed_job_state(r, RunKeys.of(run_id), job_id, grace_ms)
        if claim == "waiting":
            watch.reschedule_active(r, run_id, now_ms() + grace_ms)
            return None
        if claim == "never":
            return f"claimed, its lease not taken in {claim_grace:g} s", "lease_expiry", True
        return "lease expired", "lease_expiry", True
    return f"its job is {job_state}", "job_lost", True


def _job_state(r: Redis, run_id: str, job_id: str) -> str:
    # Only the status field: a job hash that does not decode must not stop the reaper from acting.
    raw = r.hget(Job.key_for(job_id), "status")
    if raw is None:
        return "missing"
    status = raw.decode("utf-8", errors="replace")
    if status == JobStatus.QUEUED.value:
        queue = turn_queue(r, queue_of(r, run_id))
        if queue.get_job_position(job_id) is None:
            # Dequeued and claimed: its execution is in the started registry (a threaded worker leaves the
            # job hash `queued`, agentpool.worker.lean; a dead claimer's turn is taken over like any
            # started one's). Dequeued and not claimed yet: still in the intermediate queue, and a worker
            # claims it at once or _give_back_stranded returns it.
            if job_id in queue.started_job_registry:
                return "started"
            return "waiting" if r.lpos(queue.intermediate_queue_key, job_id) is not None else "lost from the queue"
    return "waiting" if status in WAITING else status


class ReaperThread(threading.Thread):
    """Runs ``reap_once`` every ``interval`` seconds in whichever worker takes the lock first, and moves
    due deferred turns onto the queue in every worker: that move is atomic (``deferred.promote_due``), so
    it needs no lock. Each of the pool's *n* workers looks every ``PROMOTE_EVERY`` × *n* seconds (at most
    ``PROMOTE_AT_LEAST_EVERY``), at a random moment in that span: the pool looks about every
    ``PROMOTE_EVERY`` seconds in all, and a turn is enqueued within a fraction of a second of its due time
    while any worker lives (a killed worker's looks are simply missing from the others'). *n* counts the
    workers of this worker's own queues (RQ's set of workers by queue), not every RQ worker of the Redis:
    an app's own RQ workers on the same Redis would make the pool look too seldom."""

    def __init__(self, r: Redis, owner: str, interval: float, queues: Sequence[str]) -> None:
        super().__init__(name="agentpool-reaper", daemon=True)
        self.r, self.owner, self.interval = r, owner, interval
        self.queues = list(queues)
        self.stopping = threading.Event()
        self.workers = 1
        self._counted_at = -WORKERS_COUNTED_EVERY

    def run(self) -> None:
        tick = min(self.interval, PROMOTE_EVERY)
        next_scan = time.monotonic() + self.interval
        next_promote = 0.0
        while not self.stopping.wait(tick):
            try:
                now = time.monotonic()
                if now >= next_scan:
                    next_scan = now + self.interval
                    if self.r.set(REAPER_LOCK, self.owner, nx=True, px=max(100, int(self.interval * 1000) - 50)):
                        reap_once(self.r)  # which moves the due deferred turns first
                        next_promote = now + self.promote_gap()
                        continue
                if now >= next_promote:
                    _promote(self.r)
                    next_promote = now + self.promote_gap()
            except RedisError as exc:
                log.warning("reaper: Redis unavailable (%s); will retry", exc)
            except Exception:
                log.exception("reaper: unexpected error")

    def promote_gap(self) -> float:
        """Seconds until this worker's next look for due deferred turns: random, about the pool's size
        times ``PROMOTE_EVERY`` (the size read every ``WORKERS_COUNTED_EVERY`` s: the most workers any of
        this worker's queues has)."""
        now = time.monotonic()
        if now - self._counted_at >= WORKERS_COUNTED_EVERY:
            self._counted_at = now
            with self.r.pipeline(transaction=False) as pipe:
                for queue in self.queues:
                    pipe.scard(WORKERS_BY_QUEUE_KEY % queue)
                counts = pipe.execute()
            self.workers = max(1, *(int(count) for count in counts))
        return min(PROMOTE_AT_LEAST_EVERY, PROMOTE_EVERY * self.workers * random.uniform(0.5, 1.5))

    def stop(self) -> None:
        self.stopping.set()
