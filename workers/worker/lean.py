"""RQ's per-job bookkeeping, cut to what agentpool's turn jobs use.

A turn is one RQ job, and RQ's own bookkeeping for a job (measured by ``agentpool bench --only redis``)
costs Redis 52 commands on the threaded worker and 66 on the forking one, more than agentpool's own
durable work. Most of it keeps records agentpool never reads: an execution hash and its per-job index,
a result stream, the finished registry, the job hash kept for a minute after it ended, the worker's
heartbeat and state re-sent several times per job. For a **turn job** (``is_turn_job``) the workers
here do instead:

- start (one round trip, when the worker prepares the execution): the job hash says ``started``, the
  execution joins the queue's started registry (``rq:wip:<queue>``, what ``rq info`` counts as
  executing and RQ's cleanup reads) and leaves RQ's intermediate queue; the worker's state becomes
  ``busy`` only if it was not. The execution's id starts with a tag of the worker's name
  (``execution_tag``): the supervisor finds a dead threaded worker's turns in the started registries by
  it, so RQ's per-worker execution index is not written twice a turn. With the workers' own dequeue
  (``dequeue_claimed``) the start rides in the round trip that fetches the job just dequeued, and the
  job hash keeps saying ``queued`` (its entry in the started registry says it runs, which is what the
  reaper, the supervisor and RQ's cleanup read);
- end: the job hash and its registry entry are deleted, by the turn's save point B itself when it
  makes one (``note_execution``: no round trip of its own), else in one round trip as the job ends.
  Its result is not kept (a turn's job returns a one-word summary; the run's checkpoint is the
  truth), so ``rq info`` counts no turn job as ``finished``; the worker's ``successful_job_count`` and
  ``total_working_time`` are added with its next heartbeat (every few seconds);
- nothing else per job: the worker's heartbeat and the ``rq suspend`` check are sent at most every
  ``HEARTBEAT_EVERY`` / ``SUSPENSION_EVERY`` seconds, not around every dequeue, and its state only when it
  changes (``idle`` once a dequeue found nothing: a worker going from one turn to the next stays
  ``busy``). The heartbeat also keeps the worker's queues in RQ's set of queues (what ``rq info``
  lists), so the turns its horses enqueue need not. Because it comes that often, the worker's RQ record
  is kept ``WORKER_TTL`` + 60 s past each one (RQ's default TTL of 420 s would list a worker killed whole
  as ``busy`` for 8 minutes), and a heartbeat that finds the record gone (Redis out of reach longer than
  that, or restarted without its data) writes it again whole, so ``rq info`` lists the worker again.

What a crash needs is unchanged: a killed horse's job is ``started`` in the started registry (RQ's
failure path runs on it as before), the supervisor finds a dead threaded worker's executions by their
tag, and agentpool's lease and reaper take the run over as always. A job that is not a turn (a bench
baseline, anything else on the queue) gets RQ's whole bookkeeping.

Turn jobs are enqueued leanly too (``agentpool.runtime.jobs.enqueue_turn``): the job hash in one HSET
and the push, instead of RQ's registration of the queue, the status and the job in separate writes.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
import uuid
from typing import Any

from redis.client import Pipeline
from rq import worker_registration
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.suspension import WORKERS_SUSPENDED
from rq.utils import as_text, now, utcformat
from rq.worker import WorkerStatus

from agentpool.runtime.faults import fault
from agentpool.runtime.jobs import ended_by_turn, keep_queues_registered, note_execution, turn_of_job_id
from agentpool.runtime.settings import Settings, server_of
from agentpool.runtime.takeover import is_turn_job
from agentpool.store.staged_job import EndedJob
from agentpool.worker import ready

HEARTBEAT_EVERY = 5.0  # seconds between the worker's own heartbeats
# RQ keeps a worker's record worker_ttl + 60 s past each heartbeat, and job_monitoring_interval (30) + 60 s
# past the ones it sends while a job runs: with 30 here both are 90 s, the longest a worker killed whole
# stays in `rq info` (docs/cli.md). Heartbeats come every HEARTBEAT_EVERY seconds, or every 15 s (threaded)
# and 30 s (a forking worker waiting on its horse) while turns run, well within it.
WORKER_TTL = 30
SUSPENSION_EVERY = 1.0  # seconds between looks at `rq suspend`'s flag
_counts_lock = threading.Lock()  # a threaded worker's turn threads count their jobs concurrently


@functools.cache
def execution_tag(worker_name: str) -> str:
    """The first characters of the ids of a worker's turn executions: 8 hex digits of its name's hash."""
    return hashlib.sha1(worker_name.encode(), usedforsecurity=False).hexdigest()[:8]


class LeanTurnJobs:
    """Mixin for RQ worker classes (before the RQ class in the bases). See the module docstring."""

    connection: Any
    name: str
    key: str
    executions: dict[str, Execution]
    job_monitoring_interval: int
    worker_ttl: int
    _state: str
    _beat_at = 0.0  # monotonic time of the last heartbeat
    _suspension_at = 0.0  # and of the last look at `rq suspend`
    _jobs_done = 0  # turn jobs ended since the last heartbeat, and their working time
    _jobs_time = 0.0
    _written_state: str | None = None  # the state Redis has for this worker
    _registering = threading.Lock()  # a threaded worker heartbeats from two threads

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("worker_ttl", WORKER_TTL)
        super().__init__(*args, **kwargs)
        self.turn_timeout = int(Settings.from_env().turn_timeout)

    # -- the worker's own records ----------------------------------------------------------------

    def register_birth(self) -> None:
        super().register_birth()  # type: ignore[misc]
        ready.note(self.key, server_of(self.connection))  # what `agentpool check --worker` looks for

    def register_death(self) -> None:
        ready.forget()
        super().register_death()  # type: ignore[misc]

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        """RQ calls this around every dequeue and job; it is sent at most every ``HEARTBEAT_EVERY``
        seconds (RQ's worker TTL is minutes), with the turn jobs counted since the last one."""
        if pipeline is None and timeout is None and time.monotonic() - self._beat_at < HEARTBEAT_EVERY:
            return
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)  # type: ignore[misc]
            self._stage_beat_extras(pipeline)
            self._beat_at = time.monotonic()
            return
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.exists(self.key)
            super().heartbeat(timeout, pipeline=pipe)  # type: ignore[misc]
            self._stage_beat_extras(pipe)
            registered = pipe.execute()[0]
        self._beat_at = time.monotonic()
        if not registered and not getattr(self, "_is_horse", False):
            self._register_again()

    def _register_again(self) -> None:
        """The worker's RQ record was gone (it expired while Redis was out of reach longer than its TTL, or
        Redis restarted without its data), so the heartbeat just wrote a record with nothing but its time,
        and ``rq info`` (whose cleanup drops a worker whose record is gone) may no longer list it: written
        again whole, as at the worker's start but for its birth, in one transaction."""
        self.log.warning(  # type: ignore[attr-defined]
            "worker %s: its RQ record was gone (expired while Redis was out of reach, or Redis restarted "
            "without its data); registered again",
            self.name,
        )
        # RQ's register_birth writes the same, but as a new worker's: it refuses a record that is there (the
        # heartbeat's) and dates the birth now.
        with self._registering, self.connection.pipeline() as pipe:
            pipe.delete(self.key)
            pipe.hset(self.key, mapping={**self.serialize(), "state": self._state})  # type: ignore[attr-defined]
            worker_registration.register(self, pipe)  # type: ignore[arg-type]
            pipe.expire(self.key, self.worker_ttl + 60)
            pipe.execute()
        self._written_state = self._state

    def _stage_beat_extras(self, pipe: Pipeline) -> None:
        self._stage_job_counts(pipe)
        keep_queues_registered(pipe, self.queues)  # type: ignore[attr-defined]

    def _stage_job_counts(self, pipe: Pipeline) -> None:
        with _counts_lock:
            done, seconds, self._jobs_done, self._jobs_time = self._jobs_done, self._jobs_time, 0, 0.0
        if done:
            pipe.hincrby(self.key, "successful_job_count", done)
            pipe.hincrbyfloat(self.key, "total_working_time", seconds)

    def count_jobs(self, done: int, seconds: float) -> None:
        with _counts_lock:
            self._jobs_done += done
            self._jobs_time += seconds

    def take_job_counts(self) -> tuple[int, float]:
        """A work horse's counts, handed to its worker (``agentpool.worker.forking``)."""
        with _counts_lock:
            counted = (self._jobs_done, self._jobs_time)
            self._jobs_done, self._jobs_time = 0, 0.0
            return counted

    def set_state(self, state: str, pipeline: Pipeline | None = None) -> None:
        """Only a change of state is written, and ``idle`` only once the worker waits for work
        (``write_idle``, from the dequeue that found nothing): RQ sets ``idle`` after every job and
        before every dequeue, two writes a turn when turns follow each other."""
        self._state = state
        if pipeline is None and (state == self._written_state or state == WorkerStatus.IDLE):
            return
        super().set_state(state, pipeline=pipeline)  # type: ignore[misc]
        self._written_state = state

    def write_idle(self) -> None:
        """The worker waited for a turn and found none: ``idle`` is written if it is not already."""
        if self._state == WorkerStatus.IDLE and self._written_state != WorkerStatus.IDLE:
            super().set_state(WorkerStatus.IDLE)  # type: ignore[misc]
            self._written_state = WorkerStatus.IDLE

    def check_for_suspension(self, burst: bool) -> None:
        """``rq suspend`` is looked at once a second, not before every dequeue, with one ``EXISTS``: RQ's
        own look (``is_suspended``) sends the worker's heartbeat with it, a transaction of five commands a
        second, where ``heartbeat`` is due every ``HEARTBEAT_EVERY`` seconds. A suspended pool goes
        through RQ's loop, which waits (heartbeating) until ``rq resume``."""
        if time.monotonic() - self._suspension_at < SUSPENSION_EVERY:
            return
        if self.connection.exists(WORKERS_SUSPENDED):
            super().check_for_suspension(burst)  # type: ignore[misc]
        self._suspension_at = time.monotonic()

    # -- a turn job's execution -------------------------------------------------------------------

    def _new_execution_id(self) -> str:
        return execution_tag(self.name) + uuid.uuid4().hex[:24]

    def _stage_start(self, pipe: Pipeline, queue: Queue, job_id: str, member: str, ttl: int) -> None:
        """The start of a turn job's execution (``member``: its entry in the started registry), but for its
        job hash: in the started registry, out of the intermediate queue, and the worker ``busy`` if it was
        not."""
        pipe.zadd(queue.started_job_registry.key, {member: time.time() + ttl})
        pipe.lrem(queue.intermediate_queue_key, 1, job_id)
        if self._written_state != WorkerStatus.BUSY:
            super().set_state(WorkerStatus.BUSY, pipeline=pipe)  # type: ignore[misc]

    def dequeue_claimed(self, timeout: int | None) -> tuple[Job, Queue] | None:
        """``Queue.dequeue_any`` (BLMOVE into the intermediate queue from a single queue, BLPOP from
        several; None when ``timeout`` passes, or at once with None if nothing is queued), then
        ``claim_dequeued``: the job's fetch and a turn job's start in one round trip."""
        queues = self._ordered_queues  # type: ignore[attr-defined]
        keys = [queue.key for queue in queues]
        while True:
            try:
                if len(keys) == 1 and self.get_redis_server_version() >= (6, 2, 0):  # type: ignore[attr-defined]
                    popped = self.queue_class.lmove(self.connection, keys[0], timeout)  # type: ignore[attr-defined]
                else:
                    popped = self.queue_class.lpop(keys, timeout, connection=self.connection)  # type: ignore[attr-defined]
            except DequeueTimeout:
                return None
            if popped is None:
                return None
            queue_key, job_id = (as_text(part) for part in popped)
            self.after_pop(job_id)
            queue = self.queue_class.from_queue_key(  # type: ignore[attr-defined]
                queue_key,
                connection=self.connection,
                job_class=self.job_class,  # type: ignore[attr-defined]
                serializer=self.serializer,  # type: ignore[attr-defined]
                death_penalty_class=self.death_penalty_class,  # type: ignore[attr-defined]
            )
            job = self.claim_dequeued(queue, job_id)
            if job is not None:
                break
        self.reorder_queues(reference_queue=queue)  # type: ignore[attr-defined]
        job.redis_server_version = self.get_redis_server_version()  # type: ignore[attr-defined]
        return job, queue

    def after_pop(self, job_id: str) -> None:
        """Called between the pop and the claim (a job in RQ's intermediate queue only): a fault point."""

    def claimed_member(self, job: Job) -> str:
        """The job's member in its queue's started registry if this worker claimed it, else ''."""
        claimed = getattr(job, "_agentpool_claimed", None)
        return f"{job.id}:{claimed}" if claimed else ""

    def claim_dequeued(self, queue: Queue, job_id: str) -> Job | None:
        """Fetch the job just dequeued from ``queue``; a turn job's start (``_stage_start``) rides in the same
        round trip, so ``prepare_execution`` has nothing left to write. None if the job hash is gone (RQ
        skips such a job too). A turn job's hash keeps ``status: queued`` (one write less a turn): its entry
        in the started registry is what says it runs (``agentpool.runtime.reaper``, the supervisor)."""
        turn = turn_of_job_id(job_id)
        lean = turn is not None  # a guess by the id: the job's function tells for sure
        execution_id = self._new_execution_id()
        member = f"{job_id}:{execution_id}"  # Execution.composite_key
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.hgetall(Job.key_for(job_id))
            if lean:
                ttl = self.job_monitoring_interval + 60  # get_heartbeat_ttl for a fresh job; the heartbeat refines it
                self._stage_start(pipe, queue, job_id, member, ttl)
            data, *_ = pipe.execute()
        if lean:
            self._state = self._written_state = WorkerStatus.BUSY
        job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)  # type: ignore[attr-defined]
        try:
            if not data:
                raise NoSuchJobError(job_id)
            job.restore(data)
        except Exception as exc:
            if lean:  # nothing runs under that execution
                self.connection.zrem(queue.started_job_registry.key, member)
            if isinstance(exc, NoSuchJobError):
                return None
            if lean:
                # Out of every queue now, so no worker takes it again (and dies on it again): its run's
                # checkpoint is the truth, and the reaper re-enqueues the turn under a new job.
                self.log.error("Worker %s: job %s does not decode (%s); dropped", self.name, job_id, exc)  # type: ignore[attr-defined]
                return None
            exc.job_id, exc.queue = job_id, queue  # type: ignore[attr-defined]  # as RQ's dequeue reports it
            raise
        if turn is not None and is_turn_job(job):
            job._agentpool_claimed = execution_id  # type: ignore[attr-defined]
            # This worker's AGENTPOOL_TURN_TIMEOUT, not the one of whoever enqueued the turn (an app's,
            # unset, for a run's first turn): a forking worker's horse is held to it (RQ's death penalty).
            job.timeout = self.turn_timeout
            fault("after_claim_killed", *turn)
        elif lean:  # not a turn job after all: RQ's whole bookkeeping, under an execution of its own
            self.connection.zrem(queue.started_job_registry.key, member)
        return job

    def prepare_execution(self, job: Job) -> Execution:
        if not is_turn_job(job):
            return super().prepare_execution(job)  # type: ignore[misc,no-any-return]
        claimed = getattr(job, "_agentpool_claimed", None)
        execution_id = claimed or self._new_execution_id()
        execution = Execution(id=execution_id, job_id=job.id, connection=self.connection, worker_name=self.name)
        execution._job = job
        started = now()
        queue = Queue(job.origin, connection=self.connection)
        if not claimed:
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.hset(
                    job.key,
                    mapping={
                        "status": JobStatus.STARTED.value,
                        "started_at": utcformat(started),
                        "worker_name": self.name,
                    },
                )
                self._stage_start(pipe, queue, job.id, execution.composite_key, self.get_heartbeat_ttl(job))  # type: ignore[attr-defined]
                pipe.execute()
        self._state = self._written_state = WorkerStatus.BUSY
        job._status = JobStatus.STARTED
        job.started_at, job.worker_name = started, self.name
        note_execution(job, queue.started_job_registry.key, execution.composite_key)  # its save point B ends it
        self.executions[execution.id] = execution
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        if not is_turn_job(job):
            super().prepare_job_execution(job, remove_from_intermediate_queue)  # type: ignore[misc]
            return
        self.procline(f"Processing {job.func_name} from {job.origin} since {time.time()}")  # type: ignore[attr-defined]

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        if not is_turn_job(job):
            super().handle_execution_ended(job, queue, heartbeat_ttl)  # type: ignore[misc]
            return
        job.ended_at = now()

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: Any, execution: Execution) -> None:
        if not is_turn_job(job):
            super().handle_job_success(job, queue, started_job_registry, execution)  # type: ignore[misc]
            return
        if not ended_by_turn(job):  # a turn that ended without save point B (the run ended, or waits)
            with self.connection.pipeline(transaction=False) as pipe:
                EndedJob(job.key, started_job_registry.key, execution.composite_key).stage(pipe)
                pipe.execute()
        self.executions.pop(execution.id, None)
        took = (job.ended_at or now()) - (job.started_at or now())
        self.count_jobs(1, took.total_seconds())
        self.log.info("Successfully completed %s job in %ss on worker %s", job.description, took, self.name)  # type: ignore[attr-defined]

    def maintain_heartbeats(self, job: Job, execution: Execution) -> None:
        if not is_turn_job(job):
            super().maintain_heartbeats(job, execution)  # type: ignore[misc]
            return
        working = (now() - job.started_at).total_seconds() if job.started_at else 0.0
        ttl = self.get_heartbeat_ttl(job, working_time=working)  # type: ignore[attr-defined]
        with self.connection.pipeline(transaction=False) as pipe:
            self.heartbeat(self.job_monitoring_interval + 60, pipeline=pipe)
            pipe.zadd(job.started_job_registry.key, {execution.composite_key: time.time() + ttl}, xx=True)
            pipe.execute()
