"""The reaper: finds active runs whose turn has nobody working on it and re-enqueues that turn.

It reads agentpool's own state, not RQ's registries: the watch set (run id -> when to look next,
pushed forward by every lease renewal and commit), the lease, and the job id the run's header says
carries its current turn. It repairs two things: a lease that expired (the worker died or froze), and
a committed turn whose job vanished (a flushed queue, a failover that lost the push). It also denies
approvals whose deadline passed, which continues the waiting run.

Every worker runs it in a thread; a one-second lock lets one of them scan at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError
from rq.job import Job, JobStatus

from agentpool.runtime.approvals import expire_due
from agentpool.runtime.jobs import turn_queue
from agentpool.runtime.takeover import requeue_turn
from agentpool.store.checkpoint import QUEUED_RECHECK_MS
from agentpool.store.clock import now_ms
from agentpool.store.keys import REAPER_LOCK, RUNS_WATCH, RunKeys
from agentpool.store.records import ACTIVE_STATUSES

log = logging.getLogger("agentpool.reaper")
WAITING = {JobStatus.QUEUED.value, JobStatus.SCHEDULED.value, JobStatus.DEFERRED.value}


def reap_once(r: Redis, *, batch: int = 500, report: Callable[[str, str], None] | None = None) -> list[str]:
    """Look at every run that is due. Returns the ids of runs whose turn was re-enqueued; ``report``
    (``agentpool reap``) is told each thing done, as (run id, what)."""
    requeued = []
    for raw in r.zrangebyscore(RUNS_WATCH, "-inf", now_ms(), start=0, num=batch):
        run_id = raw.decode()
        try:
            found = _why_orphaned(r, run_id, report)
            if not found:
                continue
            if jid := requeue_turn(r, run_id, cause=found[1], cause_kind=found[2], dead_job=found[0]):
                requeued.append(run_id)
                if report:
                    report(run_id, f"re-enqueued as {jid} ({found[1]})")
            else:  # left alone on purpose (a newer schema, say): look again later, not every second
                r.zadd(RUNS_WATCH, {run_id: now_ms() + QUEUED_RECHECK_MS}, xx=True)
        except RedisError:
            raise
        except Exception:
            log.exception("reaper: could not check run %s", run_id)
    return requeued


def _why_orphaned(
    r: Redis, run_id: str, report: Callable[[str, str], None] | None = None
) -> tuple[str, str, str] | None:
    """None if the run is fine (when to look again is then recorded); else (its dead job, why, kind)."""
    keys = RunKeys.of(run_id)
    status, job_id = r.hmget(keys.run, ["status", "job"])
    if status == b"waiting_approval":
        denied = expire_due(r, run_id)  # due because an approval deadline passed
        if denied and report:
            report(run_id, f"denied {', '.join(denied)}: the approval expired")
        return None
    if status is None or status.decode() not in ACTIVE_STATUSES:
        r.zrem(RUNS_WATCH, run_id)
        return None
    ttl = r.pttl(keys.lease)
    if ttl > 0:
        r.zadd(RUNS_WATCH, {run_id: now_ms() + ttl})
        return None
    jid = (job_id or b"").decode()
    job_state = _job_state(r, jid) if jid else "missing"
    if job_state == "waiting":
        r.zadd(RUNS_WATCH, {run_id: now_ms() + QUEUED_RECHECK_MS})
        return None
    if job_state == "started":
        return jid, "lease expired", "lease_expiry"
    return jid, f"its job is {job_state}", "job_lost"


def _job_state(r: Redis, job_id: str) -> str:
    # Only the status field: a job hash that does not decode must not stop the reaper from acting.
    raw = r.hget(Job.key_for(job_id), "status")
    if raw is None:
        return "missing"
    status = raw.decode()
    if status == JobStatus.QUEUED.value and turn_queue(r).get_job_position(job_id) is None:
        return "lost from the queue"
    return "waiting" if status in WAITING else status


class ReaperThread(threading.Thread):
    """Runs ``reap_once`` every ``interval`` seconds in whichever worker takes the lock first."""

    def __init__(self, r: Redis, owner: str, interval: float) -> None:
        super().__init__(name="agentpool-reaper", daemon=True)
        self.r, self.owner, self.interval = r, owner, interval
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                if self.r.set(REAPER_LOCK, self.owner, nx=True, px=max(100, int(self.interval * 1000) - 50)):
                    reap_once(self.r)
            except RedisError as exc:
                log.warning("reaper: Redis unavailable (%s); will retry", exc)
            except Exception:
                log.exception("reaper: unexpected error")

    def stop(self) -> None:
        self.stopping.set()
