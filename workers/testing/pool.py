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

Workers are separate processes (kill them for real with ``kill_worker``); the scripted model runs in
this process, so a script may be a Python function of the request.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from redis import Redis

from agentpool.client import Run, RunTimeout, approve, enqueue_run, get_run, resume, wait_for_run
from agentpool.testing.localpool import RedisServer, WorkerProcesses, scratch_dir
from agentpool.testing.scripted_model import ScriptedModel

FAKE_KEY = "sk-agentpool-testing-not-a-key"  # the scripted model checks one is sent, never its value


class LocalPool:
    """A Redis, a scripted model and worker processes for one test (or a session).

    ``script``: the default script (steps, or a function of a ``ScriptRequest``), answered to every run
    that names no other; ``scripts``: named ones, picked by ``run(..., script=...)`` or a
    ``[script:NAME]`` marker in the task. ``redis_url``/``model``: use these instead of starting a
    ``redis-server``/a ``ScriptedModel`` (they are then not stopped, nor is the database flushed).
    ``cwd``: where workers import agents from (the current directory). ``env``: extra environment for
    the workers. ``lease_ttl``: short, so a killed worker's run is taken over within seconds.
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
    ) -> None:
        self._scripts: dict[str, Any] = dict(scripts or {})
        if script is not None:
            self._scripts["default"] = script
        self._n_workers, self._concurrency = workers, concurrency
        self._redis_url, self._model = redis_url, model
        self._owns_model = model is None
        self.cwd = str(cwd or os.getcwd())
        self._env, self._lease_ttl = dict(env or {}), lease_ttl
        self._names = itertools.count(1)
        self._tmp: Path | None = None
        self._redis_server: RedisServer | None = None
        self._workers: WorkerProcesses | None = None
        self._redis: Redis | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> Self:
        self._tmp = scratch_dir("agentpool-test-")
        try:
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
        if self._redis is not None:
            self._redis.close()
        if self._redis_server is not None:
            self._redis_server.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _worker_env(self) -> dict[str, str]:
        # The workers import what this process can: the current directory and its sys.path first.
        paths = [self.cwd, *(p for p in sys.path if p and os.path.isdir(p))]
        env = {k: v for k, v in os.environ.items() if k not in ("ANTHROPIC_AUTH_TOKEN", "AGENTPOOL_FAULTS")}
        assert self._model is not None and self._redis_url is not None
        env.update(
            REDIS_URL=self._redis_url,
            ANTHROPIC_BASE_URL=self._model.base_url,
            ANTHROPIC_API_KEY=FAKE_KEY,  # a real key in the environment is never sent to the stand-in
            AGENTPOOL_LEASE_TTL=str(self._lease_ttl),
            AGENTPOOL_REAPER_INTERVAL="0.25",
            AGENTPOOL_MODEL_TIMEOUT="30",
            PYTHONPATH=os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        env.update(self._env)
        return env

    # -- the parts ---------------------------------------------------------------------------------

    @property
    def redis(self) -> Redis:
        """A client of the pool's Redis, for ``agentpool`` calls of your own (``connection=pool.redis``)."""
        if self._redis is None:
            raise RuntimeError("the LocalPool is not started")
        return self._redis

    @property
    def redis_url(self) -> str:
        if self._redis_url is None:
            raise RuntimeError("the LocalPool is not started")
        return self._redis_url

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

    def start_workers(self, n: int = 1, **env: str) -> None:
        args = ["--concurrency", str(self._concurrency)] if self._concurrency > 1 else []
        self.workers.start(n, "--log-level", "INFO", *args, **env)

    def kill_worker(self, index: int = 0) -> None:
        """SIGKILL a live worker and its work horse, as a lost machine would; its run is taken over by
        another worker once its lease expires (start one with ``start_workers`` if none is left)."""
        self.workers.kill(self.workers.alive()[index])

    def logs(self) -> str:
        """The end of every worker's log (INFO: one line per run event)."""
        return self.workers.logs()

    def set_scripts(self, scripts: dict[str, Any]) -> None:
        """Add or replace named scripts (``"default"`` is the one for runs that name none)."""
        self._scripts.update(scripts)
        self.model.set_scripts(self._scripts)

    # -- runs --------------------------------------------------------------------------------------

    def enqueue(self, agent: str, task: str, *, script: Any = None, **limits: Any) -> str:
        """Enqueue a run of ``agent`` (``module:attribute``); ``script`` answers this run only."""
        if script is not None:
            name = f"run{next(self._names)}"
            self.set_scripts({name: script})
            task = f"{task} [script:{name}]"
        return enqueue_run(agent, task, connection=self.redis, **limits)

    def run(self, agent: str, task: str, *, script: Any = None, timeout: float = 60, **limits: Any) -> Run:
        """Enqueue a run and wait until it is no longer queued or running: it completed, failed, was
        stopped by a limit, or waits for an approval (``approve`` it to go on)."""
        return self.wait(self.enqueue(agent, task, script=script, **limits), timeout=timeout)

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

    def resume(self, run_id: str, *, timeout: float = 60, **amounts: Any) -> Run:
        """``agentpool.resume`` a stopped run, then wait for it as ``run`` does."""
        resume(run_id, connection=self.redis, **amounts)
        return self.wait(run_id, timeout=timeout)


@contextmanager
def local_pool(script: Any = None, **options: Any) -> Iterator[LocalPool]:
    """``with local_pool(script) as pool:`` a started :class:`LocalPool`, closed on exit."""
    with LocalPool(script, **options) as pool:
        yield pool
