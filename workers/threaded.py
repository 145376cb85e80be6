"""``agentpool worker --concurrency N``: up to N turns at once in one process, under a supervisor.

Two processes, each with one job:

- ``ThreadedWorker`` (the child) is an RQ ``BaseWorker`` that runs each turn in a thread. As FACTS.md
  ("Several turns at once in one RQ 3.0 process") found: the execution is prepared in the main thread,
  ``perform_job`` runs in a thread (RQ's success/failure handlers then run there unchanged), a turn is
  dequeued only when a slot is free, the worker stays ``busy`` while any turn runs, one thread renews
  every execution's heartbeat, and teardown joins the threads. So ``rq info`` shows it like any worker.
- ``Supervisor`` (the parent) forks the child and waits on it, as RQ's worker waits on its work horse.
  When the child dies it releases every lease the child held and re-enqueues those turns at once
  (cause_kind ``horse_death``), marks the child's RQ executions failed as RQ does for a killed horse,
  and starts a new child, backing off if children keep dying young.

Which runs the dead child held is read from RQ's own per-worker execution index
(``rq:worker:<name>:executions``, one ``<job id>:<execution id>`` member per running job). RQ adds the
member when it prepares an execution (before the turn takes its lease) and removes it in the same
transaction that records the job's end (after the turn's last write), so it covers every lease the
child can hold, costs no extra write per turn, and the same members are what must be failed in RQ's
registries. A key of our own would duplicate it; scanning ``ap:runs:watch`` costs O(active runs).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any
from uuid import uuid4

import redis.exceptions
from redis import Redis
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import DequeueTimeout, NoSuchJobError, StopRequested
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.logutils import setup_loghandlers
from rq.queue import Queue
from rq.timeouts import BaseDeathPenalty
from rq.utils import as_text, now
from rq.worker import BaseWorker, DequeueStrategy, WorkerStatus

from store.keys import TURN_QUEUE
from workers.reaper import ReaperThread
from workers.serializer import MsgpackSerializer
from workers.settings import Settings
from workers.takeover import hand_over_dead_holder

log = logging.getLogger("agentpool.threaded")

# How long the main thread blocks in one dequeue: the bound on how late a SIGTERM stops dequeuing
# (RQ's own loop blocks up to 405 s, see FACTS.md).
DEQUEUE_TIMEOUT = 1
EXIT_COLD = 1  # the child stopped without waiting for its turns; the supervisor hands them over
EXIT_WEDGED = 70  # a turn outlived its job timeout + WEDGE_GRACE: only a new process frees its slot
WEDGE_GRACE = 60  # the margin RQ's forking worker gives a horse before killing it
COLD_KILL_AFTER = 10.0  # seconds a cold-stopped child gets before the supervisor SIGKILLs it
HEALTHY_UPTIME = 30.0  # a worker process that lived this long was not dying young
MAX_BACKOFF = 30.0


class NoDeathPenalty(BaseDeathPenalty):
    """RQ's default penalty uses SIGALRM, which only works in the main thread (every threaded job
    would fail); ``TimerDeathPenalty`` starts a thread per job and still cannot interrupt a blocking
    call. A turn bounds itself (per-tool timeouts, the model client's timeout); the job timeout's
    backstop is ``ThreadedWorker._check_wedged``."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


@dataclass
class _InFlight:
    job: Job
    execution: Execution
    thread: threading.Thread


class ThreadedWorker(BaseWorker):
    death_penalty_class = NoDeathPenalty

    def __init__(self, queues: Sequence[str] = (TURN_QUEUE,), *, connection: Redis, concurrency: int = 1,
                 reaper_interval: float | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("serializer", MsgpackSerializer)
        super().__init__(list(queues), connection=connection, **kwargs)
        self.concurrency = concurrency
        self.reaper_interval = reaper_interval if reaper_interval is not None else Settings.from_env().reaper_interval
        self.exit_code = 0
        self._in_flight: dict[str, _InFlight] = {}  # execution id -> turn; reserved slots have no entry yet
        self._reserved = 0
        self._slots = threading.Condition()
        self._beating = threading.Event()

    # -- the loop ----------------------------------------------------------------------------

    def work(self, burst: bool = False, logging_level: str | None = None,
             date_format: str = DEFAULT_LOGGING_DATE_FORMAT, log_format: str = DEFAULT_LOGGING_FORMAT,
             max_jobs: int | None = None, max_idle_time: int | None = None, with_scheduler: bool = False,
             dequeue_strategy: DequeueStrategy = DequeueStrategy.DEFAULT) -> bool:
        self.bootstrap(logging_level or "INFO", date_format, log_format)
        self._dequeue_strategy = dequeue_strategy
        if with_scheduler:
            self._start_scheduler(burst, logging_level, date_format, log_format)
        self._install_signal_handlers()
        # The connection pool is thread-safe, and a blocking dequeue holds only one of its connections.
        reaper = ReaperThread(self.connection, owner=self.name, interval=self.reaper_interval)
        if self.reaper_interval > 0:
            reaper.start()
        beats = threading.Thread(target=self._keep_heartbeats, name="rq-heartbeats", daemon=True)
        beats.start()
        started = 0
        try:
            started = self._loop(burst, max_jobs, max_idle_time)
        finally:
            try:
                self._finish_in_flight()
            finally:
                self._beating.set()
                reaper.stop()
                self.teardown()
        return bool(started)

    def _loop(self, burst: bool, max_jobs: int | None, max_idle_time: int | None) -> int:
        started = 0
        connection_wait = 1.0
        idle_since = time.monotonic()
        while not self._stop_requested and (max_jobs is None or started < max_jobs):
            try:
                self.check_for_suspension(burst)
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                if not self._wait_for_free_slot():
                    break
                got = self._dequeue(burst)
                connection_wait = 1.0
            except StopRequested:  # suspended in burst mode
                break
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                log.error("worker %s: Redis unavailable (%s); retrying in %.0f s", self.name, exc, connection_wait)
                time.sleep(connection_wait)
                connection_wait = min(connection_wait * 2, self.max_connection_wait_time)
                continue
            if got is None:
                if self._busy():
                    idle_since = time.monotonic()
                    if burst:
                        self._wait_for_a_turn_to_end()  # a running turn may enqueue the next one
                    continue
                if burst:
                    log.info("worker %s: queue empty, quitting", self.name)
                    break
                if max_idle_time is not None and time.monotonic() - idle_since >= max_idle_time:
                    log.info("worker %s: idle for %d s, quitting", self.name, max_idle_time)
                    break
                continue
            if self._stop_requested:
                self._give_back(*got)  # the stop came during the dequeue that returned it
                break
            self.execute_job(*got)
            started += 1
            idle_since = time.monotonic()
        if self._stop_requested:
            log.info("worker %s: stopping; waiting for %d turn(s) in flight", self.name, len(self._in_flight))
            self.set_shutdown_requested_date()
        return started

    def _busy(self) -> bool:
        with self._slots:
            return self._reserved > 0

    def _wait_for_free_slot(self) -> bool:
        # Notifications come from turn threads; the timeout bounds how late a stop is noticed (the
        # signal handler cannot take this lock: the main thread it interrupts may hold it).
        with self._slots:
            while self._reserved >= self.concurrency and not self._stop_requested:
                self._slots.wait(timeout=DEQUEUE_TIMEOUT)
        return not self._stop_requested

    def _wait_for_a_turn_to_end(self) -> None:
        with self._slots:
            if self._reserved:
                self._slots.wait(timeout=DEQUEUE_TIMEOUT)

    def _dequeue(self, burst: bool) -> tuple[Job, Queue] | None:
        try:
            result = self.queue_class.dequeue_any(
                self._ordered_queues, None if burst else DEQUEUE_TIMEOUT, connection=self.connection,
                job_class=self.job_class, serializer=self.serializer, death_penalty_class=self.death_penalty_class,
            )
        except DequeueTimeout:
            return None
        if result is not None:
            job, queue = result
            self.reorder_queues(reference_queue=queue)
            job.redis_server_version = self.get_redis_server_version()
            log.debug("worker %s: %s: %s", self.name, queue.name, job.id)
        return result

    def _give_back(self, job: Job, queue: Queue) -> None:
        """Put a job dequeued but not started back at the head of its queue, for another worker."""
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.lpush(queue.key, job.id)
            pipe.execute()

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Prepare the execution here, in the main thread (it registers the job as started and the
        worker as busy), then perform it in a thread of its own."""
        with self._slots:
            self._reserved += 1
        try:
            execution = self.prepare_execution(job)
        except BaseException:
            self._release_slot()
            raise
        thread = threading.Thread(target=self._perform, args=(job, queue, execution), name=f"turn-{job.id}",
                                  daemon=True)  # daemon: a cold shutdown must not wait for it
        with self._slots:
            self._in_flight[execution.id] = _InFlight(job, execution, thread)
        thread.start()

    def _perform(self, job: Job, queue: Queue, execution: Execution) -> None:
        try:
            self.perform_job(job, queue, execution)
        except Exception:
            log.exception("worker %s: job %s: RQ's bookkeeping failed", self.name, job.id)
        finally:
            with self._slots:
                self._in_flight.pop(execution.id, None)
            self._release_slot()

    def _release_slot(self) -> None:
        with self._slots:
            self._reserved -= 1
            if self._reserved == 0:
                try:
                    # Under the lock: a turn prepared next sets ``busy`` only after this lands.
                    self.set_state(WorkerStatus.IDLE)
                except redis.exceptions.RedisError:
                    pass
            self._slots.notify_all()

    def _finish_in_flight(self) -> None:
        """Warm shutdown: let every turn in flight end. A cold shutdown raises out of the wait."""
        while self.exit_code != EXIT_COLD:
            with self._slots:
                threads = [t.thread for t in self._in_flight.values()]
                if not threads and not self._reserved:
                    return
            for thread in threads:
                thread.join(timeout=DEQUEUE_TIMEOUT)

    # -- heartbeats --------------------------------------------------------------------------

    def _keep_heartbeats(self) -> None:
        """One thread renews the worker's and every execution's heartbeat: without it a turn's
        started-registry entry expires and RQ's cleanup calls the job abandoned."""
        interval = min(self.job_monitoring_interval, 15)
        while not self._beating.wait(interval):
            try:
                with self._slots:
                    turns = list(self._in_flight.values())
                for turn in turns:
                    self._check_wedged(turn)
                    self.maintain_heartbeats(turn.job, turn.execution)
                if not turns:
                    self.heartbeat()
            except redis.exceptions.RedisError as exc:
                log.warning("worker %s: heartbeat failed (%s); retrying", self.name, exc)

    def _check_wedged(self, turn: _InFlight) -> None:
        """The job timeout's backstop. A thread cannot be killed, so a turn stuck past its timeout
        would hold its slot and (its lease renewed) its run for ever: the process exits instead,
        and the supervisor hands every turn it held to another worker at once, as after an OOM."""
        timeout = turn.job.timeout
        started = turn.job.started_at or turn.execution.created_at
        if timeout is None or timeout <= 0 or (now() - started).total_seconds() <= timeout + WEDGE_GRACE:
            return
        log.critical("worker %s: job %s ran past its timeout (%s s) + %s s; exiting so its turns are taken over",
                     self.name, turn.job.id, timeout, WEDGE_GRACE)
        logging.shutdown()
        os._exit(EXIT_WEDGED)

    # -- signals -----------------------------------------------------------------------------

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """Warm shutdown. Only flags: the main thread may be inside a Redis call (a dequeue), and
        raising there could drop a job it had just moved; the loop notices within a second."""
        self._shutdown_requested_date = now()
        signal.signal(signal.SIGINT, self.request_force_stop)
        signal.signal(signal.SIGTERM, self.request_force_stop)
        self._stop_requested = True
        log.info("worker %s [PID %d]: warm shutdown requested; press Ctrl+C again for a cold one", self.name,
                 os.getpid())

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        # The supervisor forwards a signal that may also have reached us straight (a process group,
        # a cgroup): one within a second of the first is the same request, as RQ's worker pool has it.
        if self._shutdown_requested_date and (now() - self._shutdown_requested_date).total_seconds() < 1:
            return
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.warning("worker %s: cold shutdown; %d turn(s) abandoned to the supervisor", self.name,
                    len(self._in_flight))
        self.exit_code = EXIT_COLD
        raise SystemExit(EXIT_COLD)

    def request_stop_execution(self, execution_id: str) -> None:
        log.warning("worker %s: `rq` cannot stop one turn of a threaded worker; use `agentpool cancel` on its run",
                    self.name)

    def teardown(self) -> None:
        if self.scheduler:
            self.stop_scheduler()
        if self._in_flight:
            # Abandoned turns: RQ's death record would drop the execution index the supervisor reads
            # to hand them over. It registers this worker's death itself once it has.
            self.unsubscribe()
            return
        super().teardown()


# -- the supervisor ----------------------------------------------------------------------------


def hand_over_dead_worker(r: Redis, name: str, pid: int, how: str) -> list[str]:
    """After worker process ``pid`` (RQ name ``name``) died: release the leases it held, re-enqueue
    those turns, fail its RQ executions as RQ fails a killed horse's job, and record its death.
    Returns the run ids re-enqueued. Only for a process known to be gone: nothing it ran can write."""
    ghost = ThreadedWorker(connection=r, name=name, prepare_for_work=False)
    cause = f"threaded worker {pid} died ({how})"
    executions = [Execution.from_composite_key(as_text(m), connection=r) for m in r.smembers(ghost.executions_key)]
    jobs: list[tuple[Job, Execution]] = []
    requeued = []
    for execution in executions:
        execution.worker_name = name
        try:
            job = Job.fetch(execution.job_id, connection=r, serializer=MsgpackSerializer)
        except NoSuchJobError:
            continue
        jobs.append((job, execution))
        run_id = hand_over_dead_holder(r, job, f"{name}.{pid}", cause=cause)
        if run_id is not None:
            requeued.append(run_id)
    # RQ's bookkeeping after the runs are safe again: the same as its forking worker on a killed horse.
    for job, execution in jobs:
        try:
            if job.get_status() == JobStatus.STARTED:
                job.ended_at = now()
                queue = Queue(job.origin, connection=r, serializer=MsgpackSerializer)
                ghost.handle_job_failure(job, queue, exc_string=f"{cause}; its turn was re-enqueued",
                                         execution=execution)
        except redis.exceptions.RedisError:
            raise
        except Exception:
            log.exception("supervisor: could not record the failure of job %s", job.id)
    ghost.register_death()
    return requeued


def _exit_when_parent_dies(parent: int) -> None:
    """Linux: a SIGTERM (warm shutdown) when the supervisor dies, so a SIGKILLed supervisor does not
    leave an unwatched worker behind. Elsewhere nothing: such a worker still works, only unwatched."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # it died before the request was made
            os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Forks the threaded worker, waits on it, hands its turns over when it dies, restarts it."""

    def __init__(self, r: Redis, *, name: str, concurrency: int, burst: bool, logging_level: str,
                 with_scheduler: bool) -> None:
        self.r, self.name, self.concurrency, self.burst = r, name, concurrency, burst
        self.logging_level, self.with_scheduler = logging_level, with_scheduler
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
            if not clean:
                log.warning("supervisor: worker %s (pid %d) %s", self.name, child, how)
            self._bury(child, how)
            if self.stopping.is_set() or (self.burst and clean):
                return 0 if clean else 1
            # Dying young is dying before finishing one turn, soon after starting (a bad deploy, Redis
            # refusing us): back off. A worker that got work done restarts at once; a turn that kills
            # every worker it lands on is stopped by its attempt cap (workers.takeover), not by this.
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
            # Its own process group, so the supervisor can take down the scheduler process it forks too.
            os.setpgrp()
            _exit_when_parent_dies(self.pid)
            code = run_worker_process(self.r, name=self.name, concurrency=self.concurrency, burst=self.burst,
                                      logging_level=self.logging_level, with_scheduler=self.with_scheduler)
        except BaseException:
            log.exception("worker process failed")
        finally:
            logging.shutdown()
            os._exit(code)

    def _finished_a_turn(self) -> bool:
        """Read before the hand-over, which counts the dead worker's turns as failed jobs."""
        try:
            return int(self.r.hget(ThreadedWorker.redis_worker_namespace_prefix + self.name,
                                   "successful_job_count") or 0) > 0
        except redis.exceptions.RedisError:
            return False

    def _wait_child(self) -> int:
        # Blocking: a death is seen the instant it happens. Signal handlers run inside the wait (PEP 475).
        _pid, status = os.waitpid(self.child, 0)
        return status

    def _bury(self, child: int, how: str) -> None:
        """Hand over first (other workers can start on those turns now), then tidy up."""
        try:
            requeued = hand_over_dead_worker(self.r, self.name, child, how)
            if requeued:
                log.warning("supervisor: re-enqueued %d turn(s) of worker %d: %s", len(requeued), child,
                            ", ".join(requeued))
        except redis.exceptions.RedisError as exc:
            log.error("supervisor: could not hand over worker %d's turns (%s); their leases expire instead",
                      child, exc)
        _end_process_group(child)

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


def _end_process_group(pgid: int, grace: float = 3.0) -> None:
    """What the dead worker left in its process group (RQ's scheduler process, a tool's subprocess):
    SIGTERM, so a scheduler releases its locks for the next worker, then SIGKILL after ``grace``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline + 2:  # a zombie someone else must reap must not hold us for ever
        _reap_orphans()
        try:
            os.killpg(pgid, 0 if time.monotonic() < deadline else signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def _reap_orphans() -> None:
    """In a container the supervisor may be PID 1, the parent of every orphan: reap what the dead worker
    left, or it stays a zombie (and a member of its group). Called only while no worker is running."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def run_worker_process(r: Redis, *, name: str, concurrency: int, burst: bool, logging_level: str,
                       with_scheduler: bool) -> int:
    """The threaded worker itself, in the current process. Returns its exit status."""
    os.environ["RQ_WORKER_ID"] = name  # lease tokens read "<fence>:<name>.<pid>" (workers.turn)
    import workers.turn  # noqa: F401  (loaded before the first turn, not inside it)

    worker = ThreadedWorker(connection=r, name=name, concurrency=concurrency)
    try:
        worker.work(burst=burst, logging_level=logging_level, with_scheduler=with_scheduler)
    except SystemExit:
        return worker.exit_code or EXIT_COLD
    return worker.exit_code


def run_threaded_worker(r: Redis, *, name: str | None, concurrency: int, burst: bool = False,
                        logging_level: str = "INFO", with_scheduler: bool = True) -> None:
    """``agentpool worker --concurrency N``: the supervisor in this process, the worker in a child."""
    name = name or uuid4().hex
    os.environ["RQ_WORKER_ID"] = name
    setup_loghandlers(logging_level, name=log.name)
    # Imported once here, every worker process forked later starts ready (anthropic takes ~1 s to import):
    # a worker restarted after an OOM kill is dequeuing again within milliseconds.
    import workers.turn  # noqa: F401
    code = Supervisor(r, name=name, concurrency=concurrency, burst=burst, logging_level=logging_level,
                      with_scheduler=with_scheduler).run()
    if code:
        raise SystemExit(code)
