"""``agentpool worker --concurrency N``: the supervisor process above the threaded worker.

``Supervisor`` forks the threaded worker (``agentpool.worker.threaded``) and waits on it, as RQ's worker waits
on its work horse. When the child dies it first ends the child's process group (what its tools
started: see ``agentpool.worker.groups``) and waits until it is empty, then releases every lease the
child held and re-enqueues those turns at once (cause_kind ``horse_death``), marks the child's RQ
executions failed as RQ does for a killed horse, and starts a new child, backing off if children keep
dying young. A child that exits to recycle itself (too many abandoned tool threads) is replaced at once.

Which runs the dead child held is read from the queues' started registries (``rq:wip:<queue>``, one
``<job id>:<execution id>`` member per running job): a turn execution's id starts with a tag of the
worker's name (``agentpool.worker.lean.execution_tag``), so one ZSCAN per queue served, filtered by Redis,
finds them. The member is added when the worker prepares an execution (before the turn takes its
lease) and removed when the job's end is recorded (after the turn's last write), so it covers every
lease the child can hold, and the same members are what must be failed in RQ's registries. RQ's own
per-worker execution index (``rq:worker:<name>:executions``) would cost two writes a turn; it is still
read for a job that is not a turn (RQ writes it for those). The scan costs O(running jobs), once per
dead child.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from uuid import uuid4

import redis.exceptions
from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import as_text, now

from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.runtime.settings import Settings
from agentpool.runtime.takeover import forget_turn_job, hand_over_dead_holder, is_turn_job
from agentpool.store.keys import TURN_QUEUE
from agentpool.worker.groups import die_with_parent, end_process_group
from agentpool.worker.lean import execution_tag
from agentpool.worker.threaded import EXIT_COLD, EXIT_RECYCLE, ThreadedWorker

log = logging.getLogger("agentpool.supervisor")

COLD_KILL_AFTER = 10.0  # seconds a cold-stopped child gets before the supervisor SIGKILLs it
GROUP_GRACE = 3.0  # seconds the dead child's group gets between SIGTERM and SIGKILL (at most TTL/3)
HEALTHY_UPTIME = 30.0  # a worker process that lived this long was not dying young
MAX_BACKOFF = 30.0


def executions_of(r: Redis, ghost: ThreadedWorker, queues: Sequence[str]) -> list[Execution]:
    """What a dead worker was running: its turn jobs' executions, found in the started registries of the
    queues it served by their ids' tag (``agentpool.worker.lean``; a turn is not written to RQ's
    per-worker index), and any other job's, in that index."""
    members = {as_text(m) for m in r.smembers(ghost.executions_key)}
    pattern = f"*:{execution_tag(ghost.name)}*"
    for queue in queues:
        registry = Queue(queue, connection=r).started_job_registry.key
        members.update(as_text(m) for m, _ in r.zscan_iter(registry, match=pattern, count=1000))
    return [Execution.from_composite_key(m, connection=r) for m in sorted(members)]


def hand_over_dead_worker(r: Redis, name: str, pid: int, how: str, queues: Sequence[str]) -> list[str]:
    """After worker process ``pid`` (RQ name ``name``, serving ``queues``) died: release the leases it
    held, re-enqueue those turns, record its executions' end as RQ does for a killed horse's job (then
    delete the handed-over turn jobs, as the forking worker does), and record its death.
    Returns the run ids re-enqueued. Only for a process known to be gone: nothing it ran can write."""
    ghost = ThreadedWorker(connection=r, name=name, prepare_for_work=False)
    cause = f"threaded worker {pid} died ({how})"
    executions = executions_of(r, ghost, queues)
    jobs: list[tuple[Job, Execution]] = []
    requeued = []
    for execution in executions:
        execution.worker_name = name
        try:
            job = Job.fetch(execution.job_id, connection=r, serializer=MsgpackSerializer)
        except NoSuchJobError:
            continue
        except redis.exceptions.RedisError:
            raise
        except Exception:  # a job hash that does not decode: its run's lease expires, the reaper takes over
            log.exception("supervisor: could not read job %s", execution.job_id)
            continue
        jobs.append((job, execution))
        try:
            run_id = hand_over_dead_holder(r, job, f"{name}.{pid}", cause=cause)
        except redis.exceptions.RedisError:
            raise
        except Exception:  # one turn that cannot be handed over must not cost the others theirs
            log.exception("supervisor: could not hand over job %s; its lease expires instead", job.id)
            continue
        if run_id is not None:
            requeued.append(run_id)
    # RQ's bookkeeping after the runs are safe again: the same as its forking worker on a killed horse.
    for job, execution in jobs:
        try:
            if job.get_status() == JobStatus.STARTED:
                job.ended_at = now()
                queue = Queue(job.origin, connection=r, serializer=MsgpackSerializer)
                ghost.handle_job_failure(
                    job, queue, exc_string=f"{cause}; its turn was re-enqueued", execution=execution
                )
            if is_turn_job(job):  # handed over: `rq info` must not count a failure no run had
                forget_turn_job(r, job.id)
        except redis.exceptions.RedisError:
            raise
        except Exception:
            log.exception("supervisor: could not record the failure of job %s", job.id)
    ghost.register_death()
    return requeued


class Supervisor:
    """Forks the threaded worker, waits on it, hands its turns over when it dies, restarts it."""

    def __init__(
        self,
        r: Redis,
        *,
        name: str,
        concurrency: int,
        burst: bool,
        logging_level: str,
        queues: Sequence[str] = (TURN_QUEUE,),
    ) -> None:
        self.r, self.name, self.concurrency, self.burst = r, name, concurrency, burst
        self.logging_level, self.queues = logging_level, tuple(queues)
        self.pid = os.getpid()
        self.child = 0
        self.stopping = threading.Event()
        self._first_signal_at = 0.0

    def run(self) -> int:
        """Returns the exit status for this process: 0 after a warm shutdown (or a burst) that ended well."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        quick_deaths = 0
        while True:
            started = time.monotonic()
            self.child = self._fork_child()
            if self.stopping.is_set():  # the signal came while forking: nobody forwarded it
                self._signal_child(signal.SIGTERM)
            status = self._wait_child()
            child, self.child = self.child, 0
            useful = self._finished_a_turn()
            how = _describe_exit(status)
            clean = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            recycled = os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_RECYCLE
            if recycled:
                log.info("supervisor: worker %s (pid %d) recycled itself; starting a fresh one", self.name, child)
            elif not clean:
                log.warning("supervisor: worker %s (pid %d) %s", self.name, child, how)
            self._bury(child, how)
            if self.stopping.is_set() or (self.burst and clean):
                return 0 if clean or recycled else 1
            if recycled:
                quick_deaths = 0  # it did work and chose to go: not dying young
                continue
            # Dying young is dying before finishing one turn, soon after starting (a bad deploy, Redis
            # refusing us): back off. A worker that got work done restarts at once; a turn that kills
            # every worker it lands on is stopped by its attempt cap (agentpool.runtime.takeover), not by this.
            dying_young = not useful and time.monotonic() - started < HEALTHY_UPTIME
            quick_deaths = quick_deaths + 1 if dying_young else 0
            delay = 0.0 if quick_deaths <= 1 else min(MAX_BACKOFF, 0.5 * 2 ** (quick_deaths - 2))
            if delay:
                log.warning("supervisor: the worker keeps dying; restarting it in %.1f s", delay)
            if self.stopping.wait(delay):
                return 0

    def _fork_child(self) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            # The supervisor's handlers must not run here: they would signal "the child" (pid 0).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            # Its own process group, so the supervisor can take down what it leaves (a tool's subprocess).
            os.setpgrp()
            die_with_parent(self.pid)
            code = run_worker_process(
                self.r,
                name=self.name,
                concurrency=self.concurrency,
                burst=self.burst,
                logging_level=self.logging_level,
                queues=self.queues,
            )
        except BaseException:
            log.exception("worker process failed")
        finally:
            logging.shutdown()
            os._exit(code)

    def _finished_a_turn(self) -> bool:
        """Read before the hand-over, which counts the dead worker's turns as failed jobs."""
        try:
            return (
                int(self.r.hget(ThreadedWorker.redis_worker_namespace_prefix + self.name, "successful_job_count") or 0)
                > 0
            )
        except redis.exceptions.RedisError:
            return False

    def _wait_child(self) -> int:
        # Blocking: a death is seen the instant it happens. Signal handlers run inside the wait (PEP 475).
        _pid, status = os.waitpid(self.child, 0)
        return status

    def _bury(self, child: int, how: str) -> None:
        """End what the child left in its process group (a tool's subprocess), and only
        once the group is empty hand its turns over: a subprocess still running could otherwise take
        effect after the next worker has asked the tool's ``verify`` hook and been told "not happened".
        The grace before SIGKILL stays under a third of the lease TTL, so the hand-over comes before
        the leases the child held could lapse and the reaper re-enqueue its turns on its own."""
        grace = min(GROUP_GRACE, Settings.from_env().lease_ttl / 3)
        if not end_process_group(child, grace, reap=True):
            log.error("supervisor: worker %d's process group did not end; handing its turns over anyway", child)
        try:
            requeued = hand_over_dead_worker(self.r, self.name, child, how, self.queues)
            if requeued:
                log.warning(
                    "supervisor: re-enqueued %d turn(s) of worker %d: %s", len(requeued), child, ", ".join(requeued)
                )
        except redis.exceptions.RedisError as exc:
            log.error("supervisor: could not hand over worker %d's turns (%s); their leases expire instead", child, exc)
        except Exception:  # the supervisor must outlive anything a dead worker left behind
            log.exception("supervisor: could not hand over worker %d's turns; their leases expire instead", child)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:
            return  # a forked child before it reset its handlers
        first = not self.stopping.is_set()
        if not first and time.monotonic() - self._first_signal_at < 1:
            return  # the same request delivered twice (terminal and supervisor, a cgroup)
        self.stopping.set()
        if first:
            self._first_signal_at = time.monotonic()
            log.info("supervisor: warm shutdown; the worker finishes its turns in flight")
        else:
            log.warning("supervisor: cold shutdown; the worker's turns in flight are handed over")
            timer = threading.Timer(COLD_KILL_AFTER, self._kill_child, args=(self.child,))
            timer.daemon = True
            timer.start()
        self._signal_child(signal.SIGTERM)

    def _signal_child(self, signum: int) -> None:
        if self.child:
            try:
                os.kill(self.child, signum)
            except ProcessLookupError:
                pass

    def _kill_child(self, child: int) -> None:
        if child and child == self.child:
            self._signal_child(signal.SIGKILL)


def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def run_worker_process(
    r: Redis,
    *,
    name: str,
    concurrency: int,
    burst: bool,
    logging_level: str,
    queues: Sequence[str] = (TURN_QUEUE,),
) -> int:
    """The threaded worker itself, in the current process, serving ``queues`` (RQ names) in order.
    Returns its exit status."""
    os.environ["RQ_WORKER_ID"] = name  # lease tokens read "<fence>:<name>.<pid>" (agentpool.runtime.turn)
    import agentpool.runtime.turn  # noqa: F401  (loaded before the first turn, not inside it)

    worker = ThreadedWorker(queues, connection=r, name=name, concurrency=concurrency)
    try:
        # No RQ scheduler: the reaper enqueues deferred turns (agentpool.runtime.deferred).
        worker.work(burst=burst, logging_level=logging_level, with_scheduler=False)
    except SystemExit:
        return worker.exit_code or EXIT_COLD
    return worker.exit_code


def run_threaded_worker(
    r: Redis,
    *,
    name: str | None,
    concurrency: int,
    burst: bool = False,
    logging_level: str = "INFO",
    queues: Sequence[str] = (TURN_QUEUE,),
) -> None:
    """``agentpool worker --concurrency N``: the supervisor in this process, the worker in a child,
    serving ``queues`` (RQ names) in order."""
    name = name or uuid4().hex
    os.environ["RQ_WORKER_ID"] = name
    # Imported once here, every worker process forked later starts ready (anthropic takes ~1 s to import):
    # a worker restarted after an OOM kill is dequeuing again within milliseconds.
    import agentpool.runtime.turn  # noqa: F401

    code = Supervisor(
        r, name=name, concurrency=concurrency, burst=burst, logging_level=logging_level, queues=queues
    ).run()
    if code:
        raise SystemExit(code)
