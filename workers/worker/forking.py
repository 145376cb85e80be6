"""``AgentWorker``: RQ's forking worker plus what makes takeover fast.

- When a work horse dies (the OOM killer's usual victim) RQ's parent notices at once (it waits on the
  horse's pid) and calls ``work_horse_killed_handler``. We end what the horse left in its process
  group (its tools' subprocesses: ``agentpool.worker.groups``), then drop its lease and re-enqueue its
  turn right there: no waiting for a lease to expire, nor for RQ's abandoned-job cleanup (minutes).
- A horse dies with its worker (``PR_SET_PDEATHSIG``): a SIGKILLed worker leaves nothing running
  unwatched; its turn is taken over once the lease expires.
- When a horse ends normally, what its tools left in its group (a timed-out tool's subprocess) is
  ended too: a tool's subprocesses die with the process that started them.
- A reaper thread (see ``agentpool.runtime.reaper``) covers a worker killed whole, or its machine lost.
- Agent modules are imported here, in the worker process, before it forks a horse for a turn of that
  agent: every horse inherits them, so agent code is loaded once per worker process, as in the threaded
  worker (``agentpool.runtime.loader``), and new code arrives when the worker restarts.
- The durability guard is decided here too, before each fork (at most every 10 s), and inherited.
- Pool-wide counters are added up in this process and flushed about once a second
  (``agentpool.runtime.stats_flush``); a horse hands what its turn counted to its worker through a pipe,
  at each milestone of its turn (its lease, save point A, a tool about to run) and as it ends (a horse
  killed mid-turn loses what it counted since its last milestone), with the rate-limit settles that may
  wait (``agentpool.store.ratelimit.DeferredSettles``), with what it learnt of "nobody watches
  any run" (``agentpool.store.live``) and of models found unlimited (``agentpool.store.ratelimit``), so
  that the next horse need not look again for a second.
- Its horses share one Redis connection, handed down from one horse to the next
  (``agentpool.worker.handdown``), instead of each opening its own: a horse that fails, is killed, or
  leaves it anything but idle hands nothing on, and the worker opens another.
- It never runs RQ's scheduler: a deferred turn is enqueued by the reaper (``agentpool.runtime.deferred``).
- Jobs are msgpack; warm shutdown on SIGTERM lets the current turn finish, as RQ does. An idle worker's
  SIGTERM never strands a turn in RQ's intermediate queue: a turn dequeued as the stop came is given
  back to the head of the queue (``_shutdown``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from typing import Any

import redis.exceptions
from redis import Redis
from rq import Worker
from rq.exceptions import StopRequested
from rq.worker import WorkerStatus

from agentpool.runtime import connections, durability, mcp_hub, tracing
from agentpool.runtime.faults import fault
from agentpool.runtime.jobs import give_back, turn_of_job_id
from agentpool.runtime.loader import load_agent
from agentpool.runtime.reaper import ReaperThread
from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.runtime.settings import Settings
from agentpool.runtime.stats_flush import StatsFlusher
from agentpool.runtime.takeover import forget_turn_job, hand_over_dead_holder, is_turn_job
from agentpool.runtime.webhook_delivery import WebhookThread
from agentpool.store import live, ratelimit, stats
from agentpool.store.keys import TURN_QUEUE, RunKeys
from agentpool.worker.channel import QuickUnsubscribe
from agentpool.worker.groups import GroupWatcher, die_with_parent, end_process_group
from agentpool.worker.handdown import HandDown
from agentpool.worker.lean import LeanTurnJobs

log = logging.getLogger("agentpool.worker")
AGENTS_REMEMBERED = 10_000  # run id -> agent path, so a turn costs no extra read to preload its agent


def _end_mcp_calls(horse: int, grace: float) -> None:
    """A horse's MCP calls still in flight in this process's hub (``agentpool.runtime.mcp_hub``) end
    with it, before anything hands its turn over, and any it asked for that the hub has not read yet is
    refused; a worker without MCP agents has no hub. ``horse`` is the horse's number (``next_horse``)."""
    hub = mcp_hub.existing_hub()
    if hub is not None:
        hub.end_calls_of(horse, grace)


# What a horse's milestones may write to its counts pipe (a line each, a few hundred bytes): with its
# last line, well within the pipe's buffer, which its worker reads only once the horse has ended.
MILESTONE_BYTES = 16 * 1024


class AgentWorker(QuickUnsubscribe, LeanTurnJobs, Worker):
    def __init__(
        self, queues: Any = (TURN_QUEUE,), *, connection: Redis, reaper_interval: float | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("serializer", MsgpackSerializer)
        kwargs.setdefault("work_horse_killed_handler", self._on_horse_killed)
        super().__init__(list(queues), connection=connection, **kwargs)
        settings = Settings.from_env()
        self._handed_over: set[str] = set()  # turn jobs whose dead horse's turn was handed over
        self.reaper_interval = reaper_interval if reaper_interval is not None else settings.reaper_interval
        # SIGTERM to SIGKILL for what a horse left: under a third of the lease TTL, so the hand-over comes
        # before the dead horse's lease could lapse and the reaper re-enqueue its turn on its own.
        self.group_grace = min(3.0, settings.lease_ttl / 3)
        self.flush_interval = settings.flush_interval
        self._agents: dict[str, str] = {}
        self._group_watcher = GroupWatcher()
        self._counts_pipe: tuple[int, int] | None = None  # the horse's counters come back through it
        self._hand_down: HandDown | None = None  # the Redis connection each horse gets (made at the first fork)
        self._mcp_horse = 0  # the number of the latest horse, as the MCP hub knows it

    @property
    def dequeue_timeout(self) -> int:
        """How long one BLMOVE waits for a turn: RQ's 405 s would make it raise the socket timeout of the
        pool every turn, heartbeat and lease renewal of this worker shares to 415 s (see
        ``agentpool.runtime.connections``); an idle worker asks again every few seconds instead."""
        return connections.DEQUEUE_BLOCK

    @property
    def connection_timeout(self) -> float:
        """What RQ raises a lower socket timeout of its connection to (``BaseWorker._set_connection``):
        agentpool's own, above the dequeue's block."""
        return connections.socket_timeout()

    def _shutdown(self) -> None:
        """A warm stop (SIGTERM). RQ's, when the worker is idle, raises StopRequested from the signal
        handler wherever the main thread is: inside the BLMOVE (whose reply, a job RQ already moved to
        its intermediate queue, is then never read) or between that BLMOVE and the execution that claims
        the job. Either way the turn sits in the intermediate queue, on no queue, until the reaper's
        recheck (30 s). So an idle worker only takes note: its dequeue ends within ``DEQUEUE_BLOCK``,
        and a turn it dequeued meanwhile is given back to the head of the queue."""
        if self.get_state() == WorkerStatus.BUSY:
            super()._shutdown()  # the turn in flight finishes, then the worker stops
            return
        self._stop_requested = True

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        """RQ's dequeue loop, one BLMOVE at a time (its own waits on for ever), so that a stop is seen
        between two; a turn dequeued once a stop was asked for is given back instead of returned. The
        dequeued job is fetched and claimed in one round trip (``LeanTurnJobs.dequeue_claimed``)."""
        self.set_state(WorkerStatus.IDLE)  # noted; written only once a dequeue finds nothing (write_idle)
        self.procline("Listening on " + ",".join(self.queue_names()))
        started = time.monotonic()
        connection_wait = 1.0
        while True:
            if self._stop_requested:
                raise StopRequested()  # RQ's loop ends the worker on it (warm: nothing was dequeued)
            left = None if max_idle_time is None else max_idle_time - (time.monotonic() - started)
            if left is not None and left <= 0:
                return None
            once = None if timeout is None else max(1, math.ceil(min(timeout, left if left is not None else timeout)))
            try:
                # RQ's loop looks at `rq suspend` only between two dequeues it makes itself; this loop
                # waits here instead, so an idle worker takes no turn once the pool is suspended.
                self.check_for_suspension(timeout is None)
                if self._stop_requested:
                    raise StopRequested()
                self.heartbeat()
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                result = self.dequeue_claimed(once)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                log.error("worker %s: Redis unavailable (%s); retrying in %.0f s", self.name, exc, connection_wait)
                time.sleep(connection_wait)
                connection_wait = min(connection_wait * self.exponential_backoff_factor, self.max_connection_wait_time)
                continue
            connection_wait = 1.0
            if result is None and timeout is None:
                return None  # burst mode: nothing queued
            if result is None:
                self.write_idle()
                continue
            job, queue = result
            if self._stop_requested:
                returned = give_back(self.connection, queue, job.id, self.claimed_member(job))
                log.info("worker %s: stopping; turn job %s given back to the queue (%s)", self.name, job.id, returned)
                raise StopRequested()
            self.log.info("Worker %s: %s: %s", self.name, queue.name, job.id)
            return result

    def after_pop(self, job_id: str) -> None:
        turn = turn_of_job_id(job_id)
        if turn is not None:
            fault("after_dequeue", *turn)
            fault("after_dequeue_killed", *turn)

    def _on_horse_killed(self, job: Any, retpid: int, ret_val: int, rusage: Any) -> None:
        # An exception here would end RQ's work loop, and the worker with it: never let one out.
        try:
            how = (
                f"signal {os.WTERMSIG(ret_val)}"
                if os.WIFSIGNALED(ret_val)
                else f"exit status {os.WEXITSTATUS(ret_val)}"
            )
            # First its tools' subprocesses: one still running could take effect after the next worker
            # asked the tool's verify hook and was told "not happened".
            if not end_process_group(retpid, self.group_grace):
                log.error("work horse %d's process group did not end; handing its turn over anyway", retpid)
            _end_mcp_calls(self._mcp_horse, self.group_grace)  # its MCP calls run in this process's hub
            hand_over_dead_holder(
                self.connection, job, f"{self.name}.{retpid}", cause=f"work horse {retpid} died ({how})"
            )
            if is_turn_job(job):
                self._handed_over.add(job.id)
        except Exception:
            log.exception("worker %s: could not hand over job %s; its lease expires instead", self.name, job.id)

    def handle_job_failure(self, job: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
        """RQ's bookkeeping for a killed horse (the worker's failed count, the execution), then the turn
        job is deleted rather than left in the failed registry: its turn was handed over (re-enqueued, or
        already committed), so ``rq info`` would count a failure no run had."""
        super().handle_job_failure(job, queue, *args, **kwargs)
        if job.id in self._handed_over:
            self._handed_over.discard(job.id)
            forget_turn_job(self.connection, job.id)

    def monitor_work_horse(self, job: Any, queue: Any, execution: Any) -> None:
        horse = self._horse_pid
        try:
            super().monitor_work_horse(job, queue, execution)
        finally:
            self._take_horse_counts()
            if horse:
                end_process_group(horse, self.group_grace)  # no-op (one failed killpg) when nothing is left
                _end_mcp_calls(self._mcp_horse, self.group_grace)
                self._group_watcher.watch(0)

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        self._preload_agent(job)
        durability.before_fork(self.connection)  # decided here, inherited by the horse: not once per horse
        self._worker_pid = os.getpid()  # the horse, forked next, dies with this process
        self._counts_pipe = os.pipe()
        if self._hand_down is None:
            self._hand_down = HandDown(self.connection, f"{self.name}:horses")
        self._hand_down.before_fork()
        self._mcp_horse = mcp_hub.next_horse()
        super().fork_work_horse(job, queue)
        os.close(self._counts_pipe[1])  # only the worker gets here: the horse exits in RQ's code
        self._group_watcher.watch(self._horse_pid)

    def perform_job(self, job: Any, queue: Any, execution: Any) -> bool:
        """In the horse: the turn, then what it counted goes back to the worker (``_take_horse_counts``)."""
        succeeded = False
        try:
            succeeded = super().perform_job(job, queue, execution)
            return succeeded
        finally:
            self._send_counts(succeeded)

    def _send_counts(self, succeeded: bool) -> None:
        if self._counts_pipe is None:
            return
        # A job that failed may have been cut short between a command and its reply (RQ's timeout is a
        # SIGALRM raised anywhere): its horse hands no connection on (agentpool.worker.handdown).
        handed_on = self._hand_down.give_back_from_horse() if self._hand_down and succeeded else None
        done, seconds = self.take_job_counts()
        stats.hand_over_to(None)
        counted = {
            "stats": stats.accumulate().take(),
            "jobs": [done, seconds],
            "watch": live.nobody_watched.export(),
            "unlimited": ratelimit.unlimited_models.export(),
            "settles": ratelimit.defer_settles().take(),
            "connection": handed_on,
        }
        try:
            # A few dozen counters, after at most MILESTONE_BYTES of the turn's milestones: far below a
            # pipe's buffer, so the write never waits for the worker (which reads once the horse ends).
            os.write(self._counts_pipe[1], json.dumps(counted).encode() + b"\n")
        except OSError as exc:
            log.warning("work horse: could not hand its counters to its worker: %s", exc)

    def _hand_over_so_far(self) -> None:
        """In the horse, at a turn's milestone (``stats.hand_over``): what it counted since the last one
        goes to its worker now, one line a milestone (under PIPE_BUF: written whole or not at all), so a
        horse killed mid-turn loses only what it counted since. Past MILESTONE_BYTES a turn's counts
        wait for its end."""
        if self._counts_pipe is None or self._milestone_bytes >= MILESTONE_BYTES:
            return
        counted = stats.accumulate().take()
        if not counted:
            return
        line = json.dumps({"stats": counted}).encode() + b"\n"
        try:
            os.write(self._counts_pipe[1], line)
            self._milestone_bytes += len(line)
        except OSError:
            stats.count(counted)  # kept: the next milestone, or the end, hands it over

    def _take_horse_counts(self) -> None:
        """The ended horse's counters into this process's tally (of a horse killed mid-turn: what it handed
        over at the turn's milestones)."""
        if self._counts_pipe is None:
            return
        reader, self._counts_pipe = self._counts_pipe[0], None
        chunks = []
        counted: dict[str, Any] = {}
        try:
            while chunk := os.read(reader, 1 << 16):
                chunks.append(chunk)
            # A line per milestone of the turn, then the horse's last line as it ended; a horse killed
            # mid-turn wrote only the first (and perhaps part of a line, which is left).
            for line in b"".join(chunks).split(b"\n"):
                try:
                    record = json.loads(line) if line else None
                except ValueError:
                    continue
                if isinstance(record, dict):
                    stats.count(record.get("stats") or {})
                    counted = record if "jobs" in record else counted
            if counted:
                self.count_jobs(*counted["jobs"])
                # The next horse skips the looks it need not make (agentpool.store.hints).
                live.nobody_watched.adopt(counted.get("watch") or {})
                ratelimit.unlimited_models.adopt(counted.get("unlimited") or {})
                if counted.get("settles"):
                    ratelimit.adopt_settles(self.connection, counted["settles"])
        except redis.exceptions.RedisError as exc:  # only when settles no longer wait here: sent at once
            log.warning("worker %s: could not settle its work horse's calls (%s): the budget refills", self.name, exc)
        except (OSError, ValueError) as exc:
            log.warning("worker %s: could not read its work horse's counters: %s", self.name, exc)
        finally:
            os.close(reader)
            if self._hand_down is not None:
                self._hand_down.after_horse(counted.get("connection") if isinstance(counted, dict) else None)

    def setup_work_horse_signals(self) -> None:
        # The first thing a horse does (RQ's main_work_horse): before any command, the connection its
        # worker handed down joins its pool.
        if self._hand_down is not None:
            self._hand_down.take_in_horse()
        # The horse counts its own turn from nothing (its copy of the worker's tally is the worker's to
        # flush) and hands the counts back through the pipe's write end (``perform_job``).
        stats.stop_accumulating()
        stats.accumulate()
        ratelimit.stop_deferring_settles()  # the worker's own are the worker's to send
        ratelimit.defer_settles()
        self.take_job_counts()  # the worker's own, not yet sent with its heartbeat: not the horse's to send
        if self._counts_pipe is not None:
            os.close(self._counts_pipe[0])
        self._milestone_bytes = 0
        stats.hand_over_to(self._hand_over_so_far)
        super().setup_work_horse_signals()
        # A horse whose worker was SIGKILLed would run on unwatched (nobody ends its process group or
        # reports its job): it is killed instead, and its turn is taken over once its lease expires.
        # What it started in its group (a tool's subprocesses) is ended by the worker's group watcher.
        self._group_watcher.close_in_child()
        die_with_parent(self._worker_pid, signal.SIGKILL)

    def _preload_agent(self, job: Any) -> None:
        """Import the turn's agent here, once per worker process, so the horse inherits it. A failure
        is left for the horse to meet and report (it hands the turn back)."""
        try:
            run_id = job.args[0]
            path = self._agents.get(run_id)
            if path is None:
                raw = self.connection.hget(RunKeys.of(run_id).run, "agent")
                if raw is None:
                    return
                path = raw.decode()
                if len(self._agents) >= AGENTS_REMEMBERED:
                    self._agents.clear()
                self._agents[run_id] = path
            load_agent(path)
        except Exception as exc:  # noqa: BLE001 - the horse reports it, with the run, where it belongs
            log.debug("worker %s: agent for job %s not preloaded: %s", self.name, job.id, exc)

    def work(self, *args: Any, **kwargs: Any) -> bool:
        # Every work horse is forked from this process: import the turn code here, once, or each horse
        # imports anthropic itself (~1 s of CPU per turn, measured by `agentpool bench --only overhead`).
        import agentpool.runtime.turn  # noqa: F401
        from agentpool.runtime.model import warm_up

        warm_up()
        # Traces set up here, once, not in each horse: every horse inherits the provider and its exporter
        # (the SDK restarts the batch thread in a forked child) and exports as this worker's instance.
        tracing.tracer()
        counters = StatsFlusher(connections.derive(self.connection), self.flush_interval)  # before any event can land
        counters.start()
        # The reaper gets its own connection pool: it runs beside the worker's blocking dequeue.
        reaper = ReaperThread(
            connections.derive(self.connection),
            owner=self.name,
            interval=self.reaper_interval,
            queues=self.queue_names(),
        )
        # So does the webhook thread: a receiver that hangs holds its connection to Redis idle meanwhile.
        hooks = WebhookThread(connections.derive(self.connection), worker=self.name)
        if self.reaper_interval > 0:
            reaper.start()
        hooks.start()
        # Never RQ's scheduler (not even from `rq worker --with-scheduler -w ...`): its process can outlive
        # this one holding its lock; the reaper enqueues deferred turns instead (agentpool.runtime.deferred).
        kwargs["with_scheduler"] = False
        try:
            return super().work(*args, **kwargs)
        finally:
            reaper.stop()
            counters.stop()
            hooks.stop()
            if self._hand_down is not None:
                self._hand_down.close()
