"""The threaded worker: up to N turns at once in one process, each in a thread.

``ThreadedWorker`` is an RQ ``BaseWorker`` that runs each turn in a thread. As FACTS.md ("Several
turns at once in one RQ 3.0 process") found: the execution is prepared in the main thread,
``perform_job`` runs in a thread (RQ's success/failure handlers then run there unchanged), a turn is
dequeued only when a slot is free, the worker stays ``busy`` while any turn runs, one thread renews
every execution's heartbeat, and teardown joins the threads. So ``rq info`` shows it like any worker.
It runs under the supervisor in ``agentpool.worker.supervisor``, which hands its turns over if it dies.

A tool thread that outlives its timeout is abandoned (a thread cannot be killed) and runs on, spinning
or holding its sockets, until it returns or the process ends. So the process recycles itself: once
``AGENTPOOL_MAX_ABANDONED_TOOLS`` such threads are still running, or as soon as it has no turn in
flight while any is, it stops taking turns, lets its turns in flight finish, and exits with
``EXIT_RECYCLE``; the supervisor ends its process group (the tools' subprocesses) and starts a fresh
process at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import redis.exceptions
from redis import Redis
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.timeouts import BaseDeathPenalty
from rq.utils import now
from rq.worker import BaseWorker, DequeueStrategy, WorkerStatus

from agentpool.runtime import connections
from agentpool.runtime.jobs import give_back
from agentpool.runtime.reaper import ReaperThread
from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.runtime.settings import Settings
from agentpool.runtime.stats_flush import StatsFlusher
from agentpool.runtime.toolcall import abandoned_threads
from agentpool.runtime.webhook_delivery import WebhookThread
from agentpool.store.keys import TURN_QUEUE
from agentpool.worker.channel import QuickUnsubscribe
from agentpool.worker.lean import LeanTurnJobs

log = logging.getLogger("agentpool.threaded")

# How long the main thread blocks in one dequeue: the bound on how late a SIGTERM stops dequeuing
# (RQ's own loop blocks up to 405 s, see FACTS.md).
DEQUEUE_TIMEOUT = 1
EXIT_COLD = 1  # the child stopped without waiting for its turns; the supervisor hands them over
EXIT_WEDGED = 70  # a turn outlived its job timeout + WEDGE_GRACE: only a new process frees its slot
EXIT_RECYCLE = 75  # too many abandoned tool threads: a warm exit, the supervisor starts a fresh process
WEDGE_GRACE = 60  # the margin RQ's forking worker gives a horse before killing it


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


class TurnSlots:
    """At most ``concurrency`` turns at once. A slot is reserved before a dequeue (so a turn is never
    taken off the queue with nowhere to run) and holds its turn's thread once it starts."""

    def __init__(self, concurrency: int, on_idle: Callable[[], None]) -> None:
        self.concurrency = concurrency
        self._on_idle = on_idle  # called under the lock when the last turn ends
        self._in_flight: dict[str, _InFlight] = {}  # execution id -> turn; reserved slots have no entry yet
        self._reserved = 0
        self._cond = threading.Condition()

    def busy(self) -> bool:
        with self._cond:
            return self._reserved > 0

    def running(self) -> list[_InFlight]:
        with self._cond:
            return list(self._in_flight.values())

    def idle(self) -> bool:
        with self._cond:
            return not self._in_flight and not self._reserved

    def wait_for_free(self, stopping: Callable[[], bool]) -> bool:
        """Until a slot is free; False if a stop was requested meanwhile. Notifications come from turn
        threads; the timeout bounds how late a stop is noticed (the signal handler cannot take this
        lock: the main thread it interrupts may hold it)."""
        with self._cond:
            while self._reserved >= self.concurrency and not stopping():
                self._cond.wait(timeout=DEQUEUE_TIMEOUT)
        return not stopping()

    def wait_for_one_to_end(self) -> None:
        with self._cond:
            if self._reserved:
                self._cond.wait(timeout=DEQUEUE_TIMEOUT)

    def reserve(self) -> None:
        with self._cond:
            self._reserved += 1

    def occupy(self, turn: _InFlight) -> None:
        with self._cond:
            self._in_flight[turn.execution.id] = turn

    def release(self, execution_id: str | None = None) -> None:
        with self._cond:
            if execution_id is not None:
                self._in_flight.pop(execution_id, None)
            self._reserved -= 1
            if self._reserved == 0:
                # Under the lock: a turn prepared next sets ``busy`` only after this lands.
                self._on_idle()
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._in_flight)


class ThreadedWorker(QuickUnsubscribe, LeanTurnJobs, BaseWorker):
    death_penalty_class = NoDeathPenalty

    def __init__(
        self,
        queues: Sequence[str] = (TURN_QUEUE,),
        *,
        connection: Redis,
        concurrency: int = 1,
        reaper_interval: float | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("serializer", MsgpackSerializer)
        super().__init__(list(queues), connection=connection, **kwargs)
        self.concurrency = concurrency
        settings = Settings.from_env()
        self.reaper_interval = reaper_interval if reaper_interval is not None else settings.reaper_interval
        self.max_abandoned_tools = settings.max_abandoned_tools
        self.flush_interval = settings.flush_interval
        self.exit_code = 0
        self._slots = TurnSlots(concurrency, on_idle=self._now_idle)
        self._beating = threading.Event()

    @property
    def connection_timeout(self) -> float:
        """What RQ raises a lower socket timeout of its connection to (``BaseWorker._set_connection``:
        405 s + 10 s at its defaults): agentpool's own, above this worker's 1 s dequeue, so that its
        turns, lease keeper and reaper, which share the pool, give up on a silent connection in
        seconds (``agentpool.runtime.connections``)."""
        return connections.socket_timeout()

    # -- the loop ----------------------------------------------------------------------------

    def work(
        self,
        burst: bool = False,
        logging_level: str | None = None,
        date_format: str = DEFAULT_LOGGING_DATE_FORMAT,
        log_format: str = DEFAULT_LOGGING_FORMAT,
        max_jobs: int | None = None,
        max_idle_time: int | None = None,
        with_scheduler: bool = False,
        dequeue_strategy: DequeueStrategy = DequeueStrategy.DEFAULT,
    ) -> bool:
        self.bootstrap(logging_level or "INFO", date_format, log_format)
        # RQ's bootstrap leaves the worker `started`: as RQ's own loop, it is idle until a turn comes
        # (written once a dequeue finds nothing), and its first heartbeat registers its queues for
        # `rq info` now, not when the heartbeat thread's first interval ends.
        self.set_state(WorkerStatus.IDLE)
        self.heartbeat()
        self._dequeue_strategy = dequeue_strategy
        # ``with_scheduler`` is ignored: RQ's scheduler is a process that could outlive this one holding
        # its lock; deferred turns are enqueued by the reaper (agentpool.runtime.deferred).
        self._install_signal_handlers()
        # The connection pool is thread-safe, and a blocking dequeue holds only one of its connections.
        # Before any turn counts: events land in its tally.
        counters = StatsFlusher(self.connection, self.flush_interval)
        counters.start()
        reaper = ReaperThread(
            self.connection, owner=self.name, interval=self.reaper_interval, queues=self.queue_names()
        )
        hooks = WebhookThread(self.connection, worker=self.name)
        if self.reaper_interval > 0:
            reaper.start()
        hooks.start()
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
                counters.stop()
                hooks.stop()
                self.teardown()
        return bool(started)

    def _loop(self, burst: bool, max_jobs: int | None, max_idle_time: int | None) -> int:
        started = 0
        connection_wait = 1.0
        idle_since = time.monotonic()
        while not self._stop_requested and not self._recycle_due() and (max_jobs is None or started < max_jobs):
            try:
                self.check_for_suspension(burst)
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                if not self._slots.wait_for_free(lambda: self._stop_requested or self._recycle_due()):
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
                self.write_idle()  # only if no turn is in flight (its state is idle)
                if self._slots.busy():
                    idle_since = time.monotonic()
                    if burst:
                        self._slots.wait_for_one_to_end()  # a running turn may enqueue the next one
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
            log.info("worker %s: stopping; waiting for %d turn(s) in flight", self.name, len(self._slots))
            self.set_shutdown_requested_date()
        return started

    def _recycle_due(self) -> bool:
        """Whether abandoned tool threads call for a fresh process; if so, a warm stop is requested."""
        if self.exit_code == EXIT_RECYCLE:
            return True
        running = abandoned_threads()
        if not running or (running < self.max_abandoned_tools and not self._slots.idle()):
            return False
        log.warning(
            "worker %s: %d tool thread(s) abandoned after their timeout still running; recycling this process "
            "once its %d turn(s) in flight finish",
            self.name,
            running,
            len(self._slots),
        )
        self.exit_code = EXIT_RECYCLE
        self._stop_requested = True
        return True

    def _dequeue(self, burst: bool) -> tuple[Job, Queue] | None:
        result = self.dequeue_claimed(None if burst else DEQUEUE_TIMEOUT)
        if result is not None:
            log.debug("worker %s: %s: %s", self.name, result[1].name, result[0].id)
        return result

    def _give_back(self, job: Job, queue: Queue) -> None:
        """Put a job dequeued but not started back at the head of its queue, for another worker."""
        give_back(self.connection, queue, job.id, self.claimed_member(job))

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Prepare the execution here, in the main thread (it registers the job as started and the
        worker as busy), then perform it in a thread of its own."""
        self._slots.reserve()
        try:
            execution = self.prepare_execution(job)
        except BaseException:
            self._slots.release()
            raise
        thread = threading.Thread(
            target=self._perform, args=(job, queue, execution), name=f"turn-{job.id}", daemon=True
        )  # daemon: a cold shutdown must not wait for it
        self._slots.occupy(_InFlight(job, execution, thread))
        thread.start()

    def _perform(self, job: Job, queue: Queue, execution: Execution) -> None:
        try:
            self.perform_job(job, queue, execution)
        except Exception:
            log.exception("worker %s: job %s: RQ's bookkeeping failed", self.name, job.id)
        finally:
            self._slots.release(execution.id)

    def _now_idle(self) -> None:
        try:
            self.set_state(WorkerStatus.IDLE)
        except redis.exceptions.RedisError:
            pass

    def _finish_in_flight(self) -> None:
        """Warm shutdown: let every turn in flight end. A cold shutdown raises out of the wait."""
        while self.exit_code != EXIT_COLD:
            if self._slots.idle():
                return
            for thread in [turn.thread for turn in self._slots.running()]:
                thread.join(timeout=DEQUEUE_TIMEOUT)

    # -- heartbeats --------------------------------------------------------------------------

    def _keep_heartbeats(self) -> None:
        """One thread renews the worker's and every execution's heartbeat: without it a turn's
        started-registry entry expires and RQ's cleanup calls the job abandoned."""
        interval = min(self.job_monitoring_interval, 15)
        while not self._beating.wait(interval):
            try:
                turns = self._slots.running()
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
        log.critical(
            "worker %s: job %s ran past its timeout (%s s) + %s s; exiting so its turns are taken over",
            self.name,
            turn.job.id,
            timeout,
            WEDGE_GRACE,
        )
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
        log.info(
            "worker %s [PID %d]: warm shutdown requested; press Ctrl+C again for a cold one", self.name, os.getpid()
        )

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        # The supervisor forwards a signal that may also have reached us straight (a process group,
        # a cgroup): one within a second of the first is the same request, as RQ's worker pool has it.
        if self._shutdown_requested_date and (now() - self._shutdown_requested_date).total_seconds() < 1:
            return
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.warning("worker %s: cold shutdown; %d turn(s) abandoned to the supervisor", self.name, len(self._slots))
        self.exit_code = EXIT_COLD
        raise SystemExit(EXIT_COLD)

    def request_stop_execution(self, execution_id: str) -> None:
        log.warning(
            "worker %s: `rq` cannot stop one turn of a threaded worker; use `agentpool cancel` on its run", self.name
        )

    def teardown(self) -> None:
        if len(self._slots):
            # Abandoned turns: RQ's death record would drop the execution index the supervisor reads
            # to hand them over. It registers this worker's death itself once it has.
            self.unsubscribe()
            return
        super().teardown()
