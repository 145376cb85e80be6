"""Real infrastructure for the tests: a redis-server the suite starts itself on a free port, the
scripted Messages API server, and real `agentpool worker` processes (forking RQ workers)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from workers.scripted_model import ScriptedModel

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server. ``durable`` turns on AOF (appendfsync everysec) as deploy/redis.conf does."""

    def __init__(self, workdir: Path, durable: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: run `apt-get install -y redis-server` (the suite starts its own)")
        self.binary, self.workdir, self.durable = binary, workdir, durable
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--maxmemory-policy", "noeviction"]
        args += ["--appendonly", "yes", "--appendfsync", "everysec"] if self.durable else ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return self
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
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
    return model_server


def descendants(pid: int) -> list[int]:
    """Child processes of ``pid`` (the forked work horse is in its own process group: kill both)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


class Pool:
    """Real worker processes sharing one environment (Redis, the scripted model, fault points)."""

    def __init__(self, redis_url: str, model: ScriptedModel, tmp: Path) -> None:
        self.redis_url, self.tmp = redis_url, tmp
        self.effects_path = str(tmp / "effects.jsonl")
        self.env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "ANTHROPIC_BASE_URL": model.base_url,
            "ANTHROPIC_API_KEY": "sk-test-not-a-secret",
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
            "AGENTPOOL_TEST_EFFECTS": self.effects_path,
            "AGENTPOOL_FAULT_DIR": str(tmp),
            "AGENTPOOL_LEASE_TTL": "3",
            "AGENTPOOL_REAPER_INTERVAL": "0.25",
        }
        self.workers: list[subprocess.Popen[bytes]] = []
        self._logs: list = []

    def start(self, n: int = 1, **env: str) -> list[subprocess.Popen[bytes]]:
        started = []
        for _ in range(n):
            log = open(self.tmp / f"worker-{len(self.workers)}.log", "wb")
            self._logs.append(log)
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.cli", "worker", "--log-level", "INFO"],
                env={**self.env, **env}, cwd=str(TESTS), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.workers.append(proc)
            started.append(proc)
        return started

    def effects(self) -> list[dict]:
        from pool_agents import effects

        return effects(self.effects_path)

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL, with_horse: bool = True) -> None:
        targets = descendants(proc.pid) if with_horse else []
        for pid in [proc.pid, *targets]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                self.kill(proc)
            proc.wait(timeout=10)
        for log in self._logs:
            log.close()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.tmp.glob("worker-*.log")))


@pytest.fixture
def pool(r: Redis, redis_server: RedisServer, model: ScriptedModel, tmp_path: Path) -> Iterator[Pool]:
    p = Pool(redis_server.url, model, tmp_path)
    yield p
    p.stop()


def assert_valid_conversation(messages: list[dict]) -> None:
    """What the Messages API demands, checked independently of the scripted server: every tool_use has
    exactly one tool_result, first in the very next user message, in order; no stray results."""
    assert messages and messages[0]["role"] == "user"
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] != "assistant" or isinstance(content, str):
            continue
        ids = [b["id"] for b in content if b["type"] == "tool_use"]
        if not ids:
            continue
        assert i + 1 < len(messages), f"messages[{i}] has tool_use {ids} and nothing after it"
        following = messages[i + 1]
        assert following["role"] == "user", f"messages[{i + 1}] should carry the tool results"
        results = [b for b in following["content"] if b["type"] == "tool_result"]
        assert [b["tool_use_id"] for b in results] == ids, f"results {results} do not answer {ids} in order"
        assert following["content"][: len(ids)] == results, "tool_result blocks must come first"


def script_task(name: str, text: str = "Summarize this week's meeting notes") -> str:
    return f"{text} [script:{name}]"


def dump(obj: object) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
