"""``LocalPool``: your agents on a real pool in a test, without an API key.

A throwaway ``redis-server``, the scripted Messages API (``agentpool.testing.scripted_model``) in this
process, and real ``agentpool worker`` processes that import your agents from the current directory::

    from agentpool.testing import local_pool

    def test_refund_is_refused_when_the_credit_is_denied():
        script = [
            {"tool_calls": [{"name": "issue_credit", "input": {"order": "A-17", "cents": 500}}]},
            {"branches": [
                {"when": {"tool": "issue_credit", "is_error": True}, "text": "I could not issue the credit."},
                {"text": "Credit issued."}]},
        ]
        with local_pool(script) as pool:
            run = pool.run("myapp.agents:support", "Refund order A-17")   # stops at waiting_approval
            run = pool.approve(run.id, approved=False, reason="over the limit")
            assert run.result == "I could not issue the credit."

Workers are separate processes, killed for real: ``kill_turn(run_id)`` SIGKILLs the worker (or only
the work horse) running that run's turn, and ``enqueue(..., kill_at="in_tool", kill_tool="charge")``
kills whatever process reaches that point of that run (``agentpool.runtime.faults``); both raise
:class:`NothingKilled` when nothing was killed, so a crash test cannot pass without a crash. The
scripted model runs in this process, so a script may be a Python function of the request.

``LocalPool(shards=2)`` is a sharded pool (docs/sharding.md): a redis-server per shard, workers started
per shard (``--shard N``), and ``pool.redis`` an ``agentpool.Shards`` to pass as ``connection=``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from redis import Redis

from agentpool.client import Run, RunTimeout, approve, enqueue_run, get_run, new_run_id, resume, wait_for_run
from agentpool.runtime.faults import POINTS, TOOL_POINTS
from agentpool.runtime.shards import Shards, route
from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.store.records import ACTIVE_STATUSES
from agentpool.testing.localpool import RedisServer, WorkerProcesses, children_of, scratch_dir
from agentpool.testing.scripted_model import ScriptedModel

FAKE_KEY = "sk-agentpool-testing-not-a-key"  # the scripted model checks one is sent, never its value
# Points of a turn in a worker that ``kill_at`` can name (the others are in the process that sends a
# message or forks a run: the app's).
KILL_POINTS = tuple(p for p in POINTS if not p.endswith(("_message_commit", "_fork_commit")))


class NothingKilled(AssertionError):
    """A kill a test asked for did not happen (the run ended first, or never reached the point): the
    test would prove nothing about a crash."""


@dataclass(frozen=True)
class Kill:
    """A process a :class:`LocalPool` SIGKILLed. ``what``: ``"worker"`` (the worker and its work
    horse: a lost machine), ``"horse"`` (only the work horse: the OOM killer), or the fault point at
    which the process running the turn killed itself. ``worker``: the worker's index in start order
    (``pool.workers.procs``), -1 if unknown."""

    pid: int
    worker: int
    what: str
    run_id: str | None = None


class LocalPool:
    """A Redis, a scripted model and worker processes for one test (or a session).

    ``script``: the default script (steps, or a function of a ``ScriptRequest``), answered to every run
    that names no other; ``scripts``: named ones, picked by ``run(..., script=...)`` or a
    ``[script:NAME]`` marker in the task. ``redis_url``/``model``: use these instead of starting a
    ``redis-server``/a ``ScriptedModel`` (they are then not stopped, nor is the database flushed).
    ``cwd``: where workers import agents from (the current directory). ``env``: extra environment for
    the workers. ``lease_ttl``: short, so a killed worker's run is taken over within seconds.

    ``shards`` (2 or more): a sharded pool, a redis-server per shard (or ``redis_urls``, one per shard, which
    are then not stopped nor flushed); ``start_workers(n)`` starts ``n`` workers per shard (``--shard N``),
    ``start_workers(n, shard=N)`` on one shard only, and ``redis`` is an ``agentpool.Shards``.

    ``tool_timeout`` and ``takeover_margin`` make crash tests of idempotent tools and of ``verify``
    hooks fast: a worker that takes over a call another worker started (and may still be running)
    waits until that attempt's timeout plus the margin has passed before it repeats or verifies it:
    by default your tool's timeout (120 s) plus 5 s. ``tool_timeout`` caps every tool's timeout in the
    workers (``AGENTPOOL_MAX_TOOL_TIMEOUT``); ``takeover_margin`` sets ``AGENTPOOL_TAKEOVER_MARGIN``.
    """

    def __init__(
        self,
        script: Any = None,
        *,
        scripts: dict[str, Any] | None = None,
        workers: int = 1,
        concurrency: int = 1,
        redis_url: str | None = None,
        model: ScriptedModel | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        lease_ttl: float = 3.0,
        tool_timeout: float | None = None,
        takeover_margin: float | None = None,
        shards: int = 1,
        redis_urls: list[str] | None = None,
    ) -> None:
        self._scripts: dict[str, Any] = dict(scripts or {})
        if script is not None:
            self._scripts["default"] = script
        self._n_workers, self._concurrency = workers, concurrency
        self._redis_url, self._model = redis_url, model
        if redis_urls is not None and (redis_url is not None or len(redis_urls) < 2):
            raise ValueError("redis_urls names the shards of a sharded pool: two or more, and no redis_url")
        self._shard_urls: list[str] = list(redis_urls or [])
        self._n_shards = len(self._shard_urls) or shards
        self._owns_servers = not self._shard_urls
        self._owns_model = model is None
        self.cwd = str(cwd or os.getcwd())
        self._env, self._lease_ttl = dict(env or {}), lease_ttl
        if tool_timeout is not None:
            self._env.setdefault("AGENTPOOL_MAX_TOOL_TIMEOUT", str(tool_timeout))
        if takeover_margin is not None:
            self._env.setdefault("AGENTPOOL_TAKEOVER_MARGIN", str(takeover_margin))
        self.kills: list[Kill] = []  # every process this pool killed, in order
        self._whole_worker_kills: set[str] = set()
        self._names = itertools.count(1)
        self._tmp: Path | None = None
        self._redis_server: RedisServer | None = None
        self._shard_servers: list[RedisServer] = []
        self._workers: WorkerProcesses | None = None
        self._redis: Redis | Shards | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> Self:
        self._tmp = scratch_dir("agentpool-test-")
        self._arms.mkdir()
        try:
            if self.sharded:
                for n in range(self._n_shards if self._owns_servers else 0):
                    (self._tmp / f"shard-{n}").mkdir()
                    self._shard_servers.append(RedisServer(self._tmp / f"shard-{n}").start())
                    self._shard_urls.append(self._shard_servers[-1].url)
                self._redis = Shards([Redis.from_url(url) for url in self._shard_urls])
            else:
                if self._redis_url is None:
                    self._redis_server = RedisServer(self._tmp).start()
                    self._redis_url = self._redis_server.url
                self._redis = Redis.from_url(self._redis_url)
            if self._model is None:
                self._model = ScriptedModel().start()
            self._model.set_scripts(self._scripts)
            self._workers = WorkerProcesses(self._worker_env(), self._tmp, cwd=self.cwd)
            self.start_workers(self._n_workers)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._workers is not None:
            self._workers.stop()
        if self._model is not None and self._owns_model:
            self._model.stop()
        for client in (self._redis,) if isinstance(self._redis, Redis) else (self._redis or ()):
            client.close()
        for server in [self._redis_server, *self._shard_servers]:
            if server is not None:
                server.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _arms(self) -> Path:
        assert self._tmp is not None
        return self._tmp / "faults"

    def _worker_env(self) -> dict[str, str]:
        # The workers import what this process can: the current directory and its sys.path first.
        paths = [self.cwd, *(p for p in sys.path if p and os.path.isdir(p))]
        env = {k: v for k, v in os.environ.items() if k not in ("ANTHROPIC_AUTH_TOKEN", "AGENTPOOL_FAULTS")}
        assert self._model is not None and (self._redis_url is not None or self.sharded)
        env.pop("REDIS_URL", None)  # a sharded pool's workers are given their shard (--shard)
        env.pop("AGENTPOOL_SHARDS", None)
        env.update(
            **({"AGENTPOOL_SHARDS": " ".join(self._shard_urls)} if self.sharded else {"REDIS_URL": self._redis_url}),
            ANTHROPIC_BASE_URL=self._model.base_url,
            ANTHROPIC_API_KEY=FAKE_KEY,  # a real key in the environment is never sent to the stand-in
            AGENTPOOL_LEASE_TTL=str(self._lease_ttl),
            AGENTPOOL_REAPER_INTERVAL="0.25",
            AGENTPOOL_MODEL_TIMEOUT="30",
            AGENTPOOL_FAULT_ARMS=str(self._arms),  # kill_at: a point armed for one run (agentpool.runtime.faults)
            PYTHONPATH=os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        env.update(self._env)
        return env

    # -- the parts ---------------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return self._n_shards > 1

    @property
    def redis(self) -> Redis | Shards:
        """A client of the pool's Redis, for ``agentpool`` calls of your own (``connection=pool.redis``); on
        a sharded pool, the ``agentpool.Shards`` of its shards (``shard(n)``: one shard's client)."""
        if self._redis is None:
            raise RuntimeError("the LocalPool is not started")
        return self._redis

    def shard(self, n: int) -> Redis:
        """Shard ``n``'s client (a sharded pool)."""
        clients: list[Redis] | None = getattr(self._redis, "clients", None)
        if clients is None:
            raise RuntimeError("not a started sharded LocalPool (shards=2 or more)")
        return clients[n]

    @property
    def redis_url(self) -> str:
        if self.sharded:
            raise RuntimeError("a sharded LocalPool has a Redis per shard: see redis_urls")
        if self._redis_url is None:
            raise RuntimeError("the LocalPool is not started")
        return self._redis_url

    @property
    def redis_urls(self) -> list[str]:
        """Each shard's URL, shard 0 first (the pool's one URL when it is not sharded)."""
        return list(self._shard_urls) if self.sharded else [self.redis_url]

    def _client_of(self, run_id: str) -> Redis:
        return route(self.redis, run_id)

    @property
    def model(self) -> ScriptedModel:
        """The scripted Messages API: ``stats()`` counts requests and rejections."""
        if self._model is None:
            raise RuntimeError("the LocalPool is not started")
        return self._model

    @property
    def workers(self) -> WorkerProcesses:
        if self._workers is None:
            raise RuntimeError("the LocalPool is not started")
        return self._workers

    def start_workers(self, n: int = 1, *, shard: int | None = None, **env: str) -> None:
        """``n`` more worker processes (on a sharded pool, ``n`` per shard, or on ``shard`` alone)."""
        args = ["--concurrency", str(self._concurrency)] if self._concurrency > 1 else []
        if not self.sharded:
            if shard is not None:
                raise ValueError("shard= is for a sharded pool (LocalPool(shards=2))")
            self.workers.start(n, "--log-level", "INFO", *args, **env)
            return
        for each in range(self._n_shards) if shard is None else (shard,):
            self.workers.start(n, "--log-level", "INFO", "--shard", str(each), *args, **env)

    def kill_worker(self, index: int = 0) -> Kill:
        """SIGKILL the ``index``-th live worker in start order (the first by default) and its work
        horse, as a lost machine would, *whichever run it is working on, if any*: to kill the worker
        running a given run's turn, use :meth:`kill_turn`. A run it held is taken over by another worker
        once its lease expires (start one with ``start_workers`` if none is left)."""
        proc = self.workers.alive()[index]
        held = self._runs_held_by(proc.pid)
        self.workers.kill(proc)
        return self._killed(Kill(proc.pid, self.workers.procs.index(proc), "worker", held[0] if held else None))

    def kill_turn(self, run_id: str, *, horse_only: bool = False, timeout: float = 60) -> Kill:
        """SIGKILL the worker that holds ``run_id``'s turn, with its work horse (a lost machine; the run
        is taken over once its lease expires), or with ``horse_only`` only the process running the turn
        (the OOM killer): a forking worker's work horse, or the threaded process under a
        ``concurrency > 1`` worker's supervisor; its parent hands the turn over at once. Waits until a worker holds the turn (its lease names the
        process); raises :class:`NothingKilled` if the run ends, waits for an approval or is not taken
        within ``timeout`` s. A turn that ends too fast to be caught needs a slower script step
        (``"delay"``) or a named point: ``enqueue(..., kill_at=...)``."""
        deadline = time.monotonic() + timeout
        while True:
            holder, status = self._turn_holder(run_id)
            if holder is not None:
                index, pid = holder
                proc = self.workers.procs[index]
                if horse_only and pid != proc.pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue  # the turn ended meanwhile: look again
                    return self._killed(Kill(pid, index, "horse", run_id))
                self.workers.kill(proc)
                return self._killed(Kill(proc.pid, index, "worker", run_id))
            if status not in ACTIVE_STATUSES:
                raise NothingKilled(f"run {run_id} is {status}: no worker holds a turn of it, nothing was killed")
            if time.monotonic() >= deadline:
                raise NothingKilled(f"no worker took a turn of run {run_id} within {timeout:g} s: nothing was killed")
            time.sleep(0.01)

    def killed(self, run_id: str, *, timeout: float = 60) -> Kill:
        """The kill ``enqueue(..., kill_at=...)`` armed for ``run_id``, once a process reached the point
        and died there; :class:`NothingKilled` if the run stops moving (completed, failed, waiting
        for an approval...) without reaching it, or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while True:
            fired = sorted(self._arms.glob(f"fired-*-{run_id}-*"))
            if fired:
                point, _, pids = fired[0].name.removeprefix("fired-").partition(f"-{run_id}-")
                pid, _, parent = pids.partition("-")
                fired[0].unlink()
                kill = Kill(int(pid), self._worker_of(int(pid), int(parent or 0)), point, run_id)
                if run_id in self._whole_worker_kills and kill.worker >= 0:
                    self.workers.procs[kill.worker].wait(timeout=10)  # its horse killed it: gone once reaped
                return self._killed(kill)
            armed = [p for p in self._arms.glob(f"*-{run_id}") if not p.name.startswith("fired-")]
            status = self._status(run_id)
            if not armed or status not in ACTIVE_STATUSES or time.monotonic() >= deadline:
                for path in armed:
                    path.unlink(missing_ok=True)
                if sorted(self._arms.glob(f"fired-*-{run_id}-*")):
                    continue  # it fired as we looked
                what = ", ".join(p.name.removesuffix(f"-{run_id}") for p in armed) or "no point armed"
                why = f"is {status}" if status not in ACTIVE_STATUSES else f"is still {status} after {timeout:g} s"
                raise NothingKilled(
                    f"run {run_id} {why} and never reached {what}: nothing was killed (does its script make "
                    "the call that point needs?)"
                )
            time.sleep(0.01)

    def logs(self) -> str:
        """The end of every worker's log (INFO: one line per run event)."""
        return self.workers.logs()

    def set_scripts(self, scripts: dict[str, Any]) -> None:
        """Add or replace named scripts (``"default"`` is the one for runs that name none)."""
        self._scripts.update(scripts)
        self.model.set_scripts(self._scripts)

    # -- runs --------------------------------------------------------------------------------------

    def enqueue(
        self,
        agent: str,
        task: str,
        *,
        script: Any = None,
        kill_at: str | None = None,
        kill_tool: str | None = None,
        whole_worker: bool = False,
        **options: Any,
    ) -> str:
        """Enqueue a run of ``agent`` (``module:attribute``); ``script`` answers this run only.

        ``kill_at`` arms a named point for this run, once: the process that reaches it is SIGKILLed (in
        a forking worker the work horse, as the OOM killer would; in a threaded one the whole worker).
        The points: ``before_model_call``, ``mid_stream`` (the reply is streaming), ``after_model_reply``,
        ``after_save_a``, ``before_tool`` (its intent recorded, the tool not started), ``in_tool``
        (after its effect, before it returns), ``after_tool_outcome``, ``after_save_b``, and the
        compaction ones (``agentpool.runtime.faults.POINTS``). ``kill_tool`` restricts a tool point to
        that tool's call. ``whole_worker`` kills the worker with it (a lost machine: nobody can say the
        attempt ended, so a takeover waits out its tool's timeout before it repeats or verifies a call;
        see ``tool_timeout``). :meth:`killed` then says which process died, or fails if none did."""
        if kill_at is not None:
            if kill_at not in KILL_POINTS:
                raise ValueError(f"kill_at must be one of {', '.join(KILL_POINTS)}; got {kill_at!r}")
            if kill_tool is not None and kill_at not in TOOL_POINTS:
                raise ValueError(f"kill_tool goes with a tool's point ({', '.join(TOOL_POINTS)}), not {kill_at!r}")
            pool = self.redis
            options.setdefault("run_id", new_run_id(pool.for_new_run(None) if isinstance(pool, Shards) else None))
            if whole_worker:
                self._whole_worker_kills.add(options["run_id"])
            (self._arms / f"{kill_at}-{options['run_id']}").write_text((kill_tool or "") + ("\nworker" * whole_worker))
        elif kill_tool is not None or whole_worker:
            raise ValueError("kill_tool and whole_worker go with kill_at")
        if script is not None:
            name = f"run{next(self._names)}"
            self.set_scripts({name: script})
            task = f"{task} [script:{name}]"
        added = self.cwd not in sys.path
        if added:  # the agent is checked where the workers import it from (``cwd``)
            sys.path.insert(0, self.cwd)
        try:
            return enqueue_run(agent, task, connection=self.redis, **options)
        finally:
            if added:
                sys.path.remove(self.cwd)

    def run(
        self,
        agent: str,
        task: str,
        *,
        script: Any = None,
        timeout: float = 60,
        kill_at: str | None = None,
        kill_tool: str | None = None,
        whole_worker: bool = False,
        **options: Any,
    ) -> Run:
        """Enqueue a run and wait until it is no longer queued or running: it completed, failed, was
        stopped by a limit, or waits for an approval (``approve`` it to go on). With ``kill_at``, the
        process running it is killed at that point first (:meth:`enqueue`; :class:`NothingKilled` if
        it never gets there) and the run is then waited for as the pool takes it over."""
        run_id = self.enqueue(
            agent, task, script=script, kill_at=kill_at, kill_tool=kill_tool, whole_worker=whole_worker, **options
        )
        if kill_at is not None:
            self.killed(run_id, timeout=timeout)
            if not self.workers.alive():
                raise RuntimeError(
                    f"the kill at {kill_at} took the last worker with it: start one (start_workers) to take run "
                    f"{run_id} over, or use a pool of two"
                )
        return self.wait(run_id, timeout=timeout)

    def wait(self, run_id: str, timeout: float = 60) -> Run:
        try:
            return wait_for_run(run_id, timeout=timeout, connection=self.redis, poll=0.05)
        except RunTimeout as exc:
            raise RunTimeout(f"{exc}\n--- worker logs ---\n{self.logs()[-6000:]}") from None

    def get(self, run_id: str) -> Run:
        return get_run(run_id, connection=self.redis)

    def approve(
        self,
        run_id: str,
        tool_use_id: str | None = None,
        *,
        approved: bool = True,
        reason: str | None = None,
        timeout: float = 60,
    ) -> Run:
        """Decide on the call(s) the run waits on, then wait for the run as ``run`` does."""
        approve(run_id, tool_use_id, approved=approved, reason=reason, connection=self.redis)
        return self.wait(run_id, timeout=timeout)

    # -- who runs what -----------------------------------------------------------------------------

    def _killed(self, kill: Kill) -> Kill:
        self.kills.append(kill)
        return kill

    def _status(self, run_id: str) -> str:
        raw = self._client_of(run_id).hget(RunKeys.of(run_id).run, "status")
        return raw.decode() if raw else "missing"

    def _worker_of(self, *pids: int) -> int:
        """The index of the worker that is one of ``pids`` (-1: none of this pool's)."""
        return next((n for n, proc in enumerate(self.workers.procs) if proc.pid in pids), -1)

    def _lease_pid(self, run_id: str) -> int | None:
        """The process that holds the run's lease: ``<fence>:<worker name>.<pid>``."""
        raw = self._client_of(run_id).get(RunKeys.of(run_id).lease)
        tail = raw.decode(errors="replace").rpartition(".")[2] if raw else ""
        return int(tail) if tail.isdigit() else None

    def _turn_holder(self, run_id: str) -> tuple[tuple[int, int] | None, str]:
        """(index of the worker, pid of the process running the turn) once a live worker of this pool
        holds the run's lease, and the run's status."""
        status = self._status(run_id)
        pid = self._lease_pid(run_id)
        if pid is not None:
            for index, proc in enumerate(self.workers.procs):
                if proc.poll() is None and (pid == proc.pid or pid in children_of(proc.pid)):
                    return (index, pid), status
        return None, status

    def _runs_held_by(self, worker_pid: int) -> list[str]:
        pids = {worker_pid, *children_of(worker_pid)}
        clients = self.redis.clients if isinstance(self.redis, Shards) else [self.redis]
        active = [raw.decode() for r in clients for raw in r.zrange(RUNS_WATCH, 0, -1)]
        return [run_id for run_id in active if self._lease_pid(run_id) in pids]

    def resume(self, run_id: str, *, timeout: float = 60, **amounts: Any) -> Run:
        """``agentpool.resume`` a stopped run, then wait for it as ``run`` does."""
        resume(run_id, connection=self.redis, **amounts)
        return self.wait(run_id, timeout=timeout)


@contextmanager
def local_pool(script: Any = None, **options: Any) -> Iterator[LocalPool]:
    """``with local_pool(script) as pool:`` a started :class:`LocalPool`, closed on exit."""
    with LocalPool(script, **options) as pool:
        yield pool
