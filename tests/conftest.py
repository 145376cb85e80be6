"""Real infrastructure for the tests: a redis-server the suite starts itself on a free port, the
scripted Messages API server, and real `agentpool worker` processes (forking RQ workers)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from agentpool.runtime.settings import connect
from agentpool.testing import assert_valid_conversation  # noqa: F401 - the tests import it from here
from agentpool.testing.localpool import RedisNotInstalled, RedisServer, WorkerProcesses
from agentpool.testing.scripted_model import ScriptedModel

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
# A shard list in the developer's shell would send the workers and commands the tests start to those
# shards instead of the suite's redis-server; tests/test_shards.py sets its own.
os.environ.pop("AGENTPOOL_SHARDS", None)


def _redis_server(workdir: Path, durable: bool = False) -> RedisServer:
    try:
        return RedisServer(workdir, durable=durable)
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _redis_server(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    # A worker SIGKILLed by the previous test may still be blocked in BLMOVE inside Redis for a moment;
    # a job pushed then is handed to the dead client (the reaper would repair it only after 30 s).
    deadline = time.monotonic() + 10
    while client.info("clients")["blocked_clients"] and time.monotonic() < deadline:
        time.sleep(0.05)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def model_server() -> Iterator[ScriptedModel]:
    server = ScriptedModel(cache_min_tokens=64).start()
    yield server
    server.stop()


@pytest.fixture
def model(model_server: ScriptedModel) -> ScriptedModel:
    model_server.reset()
    model_server.set_scripts({})
    model_server.set_rate_limits(None)
    return model_server


class Pool(WorkerProcesses):
    """Worker processes wired to the test's Redis, the scripted model, fault points and an effects file."""

    def __init__(self, redis_url: str, model: ScriptedModel, tmp: Path) -> None:
        self.tmp = tmp
        self.effects_path = str(tmp / "effects.jsonl")
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "ANTHROPIC_BASE_URL": model.base_url,
            "ANTHROPIC_API_KEY": "sk-test-not-a-secret",
            "PYTHONPATH": str(TESTS),  # agentpool itself comes from the install, as for a user
            "AGENTPOOL_TEST_EFFECTS": self.effects_path,
            "AGENTPOOL_FAULT_DIR": str(tmp),
            "AGENTPOOL_LEASE_TTL": "3",
            "AGENTPOOL_REAPER_INTERVAL": "0.25",
            "AGENTPOOL_MODEL_TIMEOUT": "30",  # a hung call must not hide behind the heartbeat for 10 minutes
        }
        super().__init__(env, tmp, cwd=str(TESTS))
        self._clients: list[Redis] = []

    @property
    def workers(self) -> list[subprocess.Popen[bytes]]:
        return self.procs

    def client(self, plain: bool = False) -> Redis:
        """A client of the pool's Redis as an app has one (agentpool's ``connect``, which retries; ``plain``:
        redis-py's own), closed when the pool stops: a client left to the garbage collector after its
        server died or its endpoint moved can leave a socket it never closed (a ResourceWarning, an error
        here, in whichever test the collector happens to run)."""
        url = self.env["REDIS_URL"]
        made = Redis.from_url(url) if plain else connect(url)
        self._clients.append(made)
        return made

    def stop(self, sig: int = signal.SIGKILL) -> None:  # type: ignore[override]
        super().stop(sig)
        for made in self._clients:
            made.close()
        self._clients.clear()

    def start(self, n: int = 1, **env: str) -> list[subprocess.Popen[bytes]]:  # type: ignore[override]
        return super().start(n, "--log-level", "INFO", **env)

    def cli(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        """``agentpool ARGS`` as an operator on this pool runs it (its environment, plus ``env``)."""
        return subprocess.run(
            [sys.executable, "-m", "agentpool", *args],
            env={**self.env, **env},
            cwd=str(TESTS),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def effects(self) -> list[dict]:
        from pool_agents import effects

        return effects(self.effects_path)

    def wait_for_log(self, wanted: Callable[[str], bool], what: str, timeout: float = 120) -> str:
        """The first line of the workers' logs for which ``wanted`` holds (the logs are read whole)."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((line for line in self.logs(tail=10_000_000).splitlines() if wanted(line)), None)
            if found is not None:
                return found
            assert time.monotonic() < deadline, f"no log line {what}:\n{self.logs()}"
            time.sleep(0.05)

    def wait_for_effect(self, tool: str, timeout: float = 120) -> dict:
        """The first real execution of ``tool`` (say, a slow tool a test wants to crash into)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.effects() if e["tool"] == tool]
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"{tool} never ran:\n{self.logs()}")


@pytest.fixture
def pool(r: Redis, redis_server: RedisServer, model: ScriptedModel, tmp_path: Path) -> Iterator[Pool]:
    p = Pool(redis_server.url, model, tmp_path)
    yield p
    p.stop()


def wait_for_status(r: Redis, run_id: str, status: str, timeout: float = 120) -> None:
    """Until the run's header says ``status``; reads only that field, so it works on a run whose
    messages cannot be decoded, and stops at statuses ``wait_for_run`` returns on (waiting_approval)."""
    from agentpool.store.keys import RunKeys

    deadline = time.monotonic() + timeout
    while True:
        current = (r.hget(RunKeys.of(run_id).run, "status") or b"").decode("utf-8", errors="replace")
        if current == status:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} is {current}, not {status}")
        time.sleep(0.05)


class OutputLines:
    """A subprocess's output, read line by line by a thread, so that a test waits for the very line it
    asserts on, with a deadline that holds even while no line comes (a bare readline() would block)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, wanted: Callable[[str], bool], what: str, timeout: float = 120) -> str:
        """The first line for which ``wanted`` holds; an AssertionError naming ``what`` (and showing the
        lines read) if the output ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((line for line in self.lines if wanted(line)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                assert left > 0 and not self._ended, f"no line {what} in:\n" + "\n".join(self.lines)
                self._changed.wait(left)


def event_kind(line: str) -> str:
    """The event kind of a line ``agentpool watch`` printed (``23:01:02.345 handed_back  reason=...``)."""
    parts = line.split(maxsplit=2)
    return parts[1] if len(parts) > 1 else ""


def script_task(name: str, text: str = "Summarize this week's meeting notes") -> str:
    return f"{text} [script:{name}]"


CHROMIUM = os.environ.get("AGENTPOOL_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Headless Chromium for the dashboard's page tests (tests/test_dashboard*.py), one per session.
INSTALL = "apt-get update && apt-get install -y chromium chromium-driver; pip install -e '.[test]'"


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"playwright is not installed; {INSTALL}")
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing; {INSTALL}")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def run_loop(coroutine: Any) -> Any:
    """``asyncio.run`` in a thread of its own, as an app's event loop would be: a browser test that ran
    earlier in this process (Playwright's sync API) leaves its own loop marked running in the main thread."""
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, coroutine).result()


def dump(obj: object) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
