"""Turn jobs on the RQ queue: their ids, and the one place they are enqueued.

A job carries only ``(run_id, turn)``; the checkpoint in Redis is the truth. Ids are deterministic:
``<run>-t0007`` for the job save point B enqueues, ``<run>-t0007-r12`` for the run's 12th re-enqueue
(a takeover, a deferred model retry, a resume, a person's decision, a hand-back's retry), numbered by
the header's ``requeues`` counter under WATCH: every re-enqueue gets an id of its own.
"""

from __future__ import annotations

from datetime import timedelta

from redis import Redis
from redis.client import Pipeline
from rq import Queue

from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.runtime.settings import Settings
from agentpool.store.keys import TURN_QUEUE, RunKeys

TURN_FUNC = "agentpool.runtime.turn.run_turn"
RESULT_TTL = 60  # a turn job returns nothing worth keeping
FAILURE_TTL = 7 * 24 * 3600


def turn_queue(r: Redis) -> Queue:
    return Queue(TURN_QUEUE, connection=r, serializer=MsgpackSerializer)


def job_id(run_id: str, turn: int, attempt: int = 0) -> str:
    """``attempt`` is the run's re-enqueue number (its header's ``requeues``), 0 for save point B's job."""
    base = f"{run_id}-t{turn:04d}"
    return f"{base}-r{attempt}" if attempt else base


def stage_turn(pipe: Pipeline, r: Redis, run_id: str, turn: int, attempt: int = 0, *, delay: float = 0.0) -> str:
    """Add the turn's job to ``pipe``, a transaction (already in MULTI) the caller executes with its own
    writes. ``attempt`` names the job as the run's n-th re-enqueue (see ``job_id``)."""
    queue = turn_queue(r)
    jid = job_id(run_id, turn, attempt)
    options = {
        "job_id": jid,
        "pipeline": pipe,
        "job_timeout": int(Settings.from_env().turn_timeout),
        "result_ttl": RESULT_TTL,
        "failure_ttl": FAILURE_TTL,
        "description": f"agentpool turn {turn} of {run_id}",
    }
    pipe.hset(RunKeys.of(run_id).run, "job", jid)  # the reaper checks this job is still alive
    if delay > 0:
        queue.enqueue_in(timedelta(seconds=delay), TURN_FUNC, run_id, turn, **options)
    else:
        queue.enqueue(TURN_FUNC, run_id, turn, **options)
    return jid
