"""Why a run is not moving, and since when: what ``show``, ``runs``, ``watch`` and the dashboard say.

A queued or running run is, at any moment, in one of these states (``Waiting.kind``):

- ``handed_back``: the last worker that took its turn could not do it (no encryption key, a key it
  does not have, code older than the record, an agent it cannot import) and gave it back; the turn is
  re-enqueued when the backoff ends (``until``), for any worker. The reason stays until a worker
  makes progress, so a pool where *no* worker can do it says so.
- ``waiting_for_replica``: handed back because the durability guard (``AGENTPOOL_REPLICA_ACKS``) was not
  met: no replica acknowledged a tool's intent in time (after a failover that left the new primary
  without a replica, say). The run goes on once a replica acknowledges again; ``since`` is when the
  wait began.
- ``backoff``: the model API failed (429, 529, 5xx...) and the turn waits for its retry (``until``);
  it is recorded in ``ap:turns:deferred``, not yet an RQ job, and the reaper (in every worker) moves
  it onto the queue within about a second of ``until``.
- ``queued``: the turn's job waits in the queue for a free worker (``since``).
- ``in_progress``: a worker holds the run's lease and is working on the turn (or is taking it).
- ``lost``: the turn's job is gone (a flushed queue, a dead worker): the reaper re-enqueues it soon.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from redis import Redis

from agentpool.runtime.deferred import due_for_job
from agentpool.store import handback
from agentpool.store.keys import RunKeys
from agentpool.store.records import ACTIVE_STATUSES


@dataclass(frozen=True)
class Waiting:
    kind: str  # handed_back, waiting_for_replica, backoff, queued, in_progress, lost
    note: str  # one line for a person
    since: float | None = None  # epoch seconds
    until: float | None = None
    reason: str = ""  # handed_back: key_missing, key_not_held, too_new, agent_not_loadable
    detail: str = ""
    worker: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def clock(epoch: float, *, millis: bool = False) -> str:
    """A moment on this machine's clock as people read it: ``14:03:07`` (``14:03:07.250`` with ``millis``)."""
    seconds = time.strftime("%H:%M:%S", time.localtime(epoch))
    return f"{seconds}.{int(epoch * 1000) % 1000:03d}" if millis else seconds


def _rq_time(raw: bytes | None) -> float | None:
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw.decode()).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def why_waiting(r: Redis, run_id: str, status: str) -> Waiting | None:
    """What the run waits for, or None for a run that is not queued or running (its status says it)."""
    if status not in ACTIVE_STATUSES:
        return None
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.handback)
        pipe.get(keys.lease)
        pipe.hmget(keys.run, ["job", "retry_reason", "updated_at"])
        raw_handback, holder, (job_id, retry_reason, updated_at) = pipe.execute()
    now = time.time()
    record = handback.decode(raw_handback)
    if record is not None and not holder:
        when = f"next try at {clock(record.until)}" if record.until > now else "being re-enqueued"
        if record.reason == "not_replicated":
            return Waiting(
                "waiting_for_replica",
                f"waiting for a replica to acknowledge since {clock(record.since)} ({record.count} tries, last "
                f"by {record.worker}: {record.detail}); {when}. Bring a replica back, or lower "
                "AGENTPOOL_REPLICA_ACKS knowingly",
                since=record.since,
                until=record.until,
                reason=record.reason,
                detail=record.detail,
                worker=record.worker,
            )
        # Not running in any useful sense: it waits for a worker with the agent's code.
        head = "waiting for a worker that can load its agent: " if record.reason == "agent_not_loadable" else ""
        return Waiting(
            "handed_back",
            f"{head}handed back {record.count} time(s) since {clock(record.since)}, last by {record.worker}: "
            f"{record.describe()} ({record.detail}); {when}",
            since=record.since,
            until=record.until,
            reason=record.reason,
            detail=record.detail,
            worker=record.worker,
        )
    if holder:
        worker = holder.decode("utf-8", errors="replace").partition(":")[2]
        since = int(updated_at or 0) / 1000 or None
        return Waiting("in_progress", f"a turn is in progress on worker {worker}", since=since, worker=worker)
    jid = (job_id or b"").decode("utf-8", errors="replace")
    due_ms = due_for_job(r, run_id, jid) if jid else None
    if due_ms is not None:
        until = due_ms / 1000
        why = (retry_reason or b"").decode("utf-8", errors="replace") or "a transient model error"
        note = f"waiting on a backoff after {why}, until {clock(until)}"
        if until < now - 5:
            note += " (overdue: is any worker or `agentpool reap` running?)"
        return Waiting("backoff", note, until=until, detail=why)
    job_status, enqueued_at, created_at = (
        r.hmget(rq_job_key(jid), ["status", "enqueued_at", "created_at"]) if jid else (None,) * 3
    )
    state = (job_status or b"").decode("utf-8", errors="replace")
    if state == "started":
        return Waiting("in_progress", "a worker is starting the turn")
    if state == "queued":
        since = _rq_time(enqueued_at) or _rq_time(created_at)
        return Waiting("queued", "waiting for a worker" + (f" since {clock(since)}" if since else ""), since=since)
    return Waiting("lost", f"its turn's job is {state or 'missing'}; the reaper re-enqueues it shortly")


def rq_job_key(job_id: str) -> str:
    """RQ's ``Job.key_for(job_id)`` (RQ 3: its ``RQ_KEY_PREFIX``, ``:job:``, the id), without importing
    RQ: reading runs (``agentpool runs``, ``show``) stays quick. A test holds the two to the same key."""
    return os.environ.get("RQ_KEY_PREFIX", "rq") + ":job:" + job_id
