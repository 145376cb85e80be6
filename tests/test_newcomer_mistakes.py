"""A newcomer's mistakes, second round: each is refused at once in one line that says what to do, or
shown for what it is (a run no worker can load waits for one, it is not "running")."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from agentpool import Agent, AgentPoolError, RedisUnreachable, enqueue_run, get_run, list_runs, tool
from agentpool.client import AgentNotLoadable
from agentpool.store import handback
from agentpool.store.keys import RUNS, RunKeys
from agentpool.testing.localpool import free_port

from conftest import TESTS, script_task


def cli(*args: str, url: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    environment.update(env)
    if url is not None:
        environment["REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "agentpool", *args],
        env=environment,
        cwd=str(TESTS),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_typo_in_the_agents_path_is_refused_at_enqueue_and_nothing_is_queued(r, redis_server):
    out = cli("enqueue", "nosuch.module:agent", "hello", url=redis_server.url)
    assert out.returncode == 1, out
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: cannot import module 'nosuch.module' for agent 'nosuch.module:agent'"), line
    assert "--no-check-agent" in line
    with pytest.raises(AgentNotLoadable, match="module 'pool_agents' has no attribute 'suport'"):
        enqueue_run("pool_agents:suport", "hello", connection=r)
    with pytest.raises(AgentNotLoadable, match="is not an agentpool Agent"):
        enqueue_run("pool_agents:effects", "hello", connection=r)
    assert r.zcard(RUNS) == 0, "nothing was created"


def test_a_run_no_worker_can_load_waits_for_one_and_says_so(r, redis_server, pool):
    out = cli("enqueue", "--no-check-agent", "only_on_the_workers:agent", script_task("x"), url=redis_server.url)
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    pool.start(1)  # a worker without that code: it hands the turn back
    deadline = time.monotonic() + 60
    while handback.read(r, RunKeys.of(run_id)) is None:
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.05)

    # Read while the turn waits, not while the worker's retry holds it (the run is then in progress).
    while (waiting := get_run(run_id, connection=r).waiting) is None or waiting["kind"] == "in_progress":
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.05)
    assert waiting["note"].startswith("waiting for a worker that can load its agent: handed back 1 time(s)"), waiting

    # The worker tries again when each backoff ends (1 s, then 2, 4...), and while it holds the turn the
    # run is in progress: each command is asked again until it shows the wait, for as long as a minute.
    deadline = time.monotonic() + 60

    def shown_once_waiting(command: tuple[str, ...], pick) -> str:
        while True:
            shown = pick(cli(*command, url=redis_server.url).stdout)
            if "waiting for a worker that can load its agent" in shown or time.monotonic() > deadline:
                return shown
            time.sleep(0.2)

    row = shown_once_waiting(("runs",), lambda out: next(line for line in out.splitlines() if line.startswith(run_id)))
    assert "waiting for a worker that can load its agent (handed back since" in row, row
    assert "cannot import module 'only_on_the_workers'" in row
    shown = shown_once_waiting(("show", run_id), lambda out: out)
    assert "now: waiting for a worker that can load its agent" in shown, shown


def test_the_api_refuses_what_is_not_an_agent_path_by_name(r):
    with pytest.raises(TypeError, match=r"import path 'module:attribute' \(a str\), got object"):
        enqueue_run(object(), "x", connection=r)
    agent = Agent(model="claude-sonnet-5-5")
    with pytest.raises(TypeError, match="as a string .* got the Agent itself"):
        enqueue_run(agent, "x", connection=r)


def test_a_redis_url_is_a_connection_too(r, redis_server):
    run_id = enqueue_run("pool_agents:support", "hello", connection=redis_server.url)
    assert get_run(run_id, connection=redis_server.url).status == "queued"
    assert [run.id for run in list_runs(connection=redis_server.url)] == [run_id]
    with pytest.raises(TypeError, match="a redis.Redis client or a Redis URL string, got int"):
        get_run(run_id, connection=6379)


def test_a_refused_connection_is_an_agentpool_error_naming_the_server_without_its_password():
    port = free_port()  # nothing listens there
    with pytest.raises(RedisUnreachable) as refused:
        get_run("r_x", connection=Redis(host="127.0.0.1", port=port, db=3, password="s3cret"))
    assert str(refused.value).startswith(f"Redis unreachable at redis://127.0.0.1:{port}/3: "), refused.value
    assert "s3cret" not in str(refused.value)
    assert isinstance(refused.value, AgentPoolError) and isinstance(refused.value, RedisConnectionError)

    with pytest.raises(RedisUnreachable, match=rf"Redis unreachable at redis://app:\*\*\*@127.0.0.1:{port}/0: "):
        list_runs(connection=f"redis://app:s3cret@127.0.0.1:{port}/0")


def test_the_default_redis_is_said_once_in_a_warning():
    code = (
        "from agentpool.runtime.settings import client_for\n"
        "client_for(None); client_for(None)\n"  # builds clients: nothing connects yet
    )
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    warned = [line for line in out.stderr.splitlines() if "Warning:" in line]
    assert len(warned) == 1, out.stderr
    assert "no connection given and REDIS_URL is not set: using redis://localhost:6379/0" in warned[0]
    quiet = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "REDIS_URL": "redis://127.0.0.1:1/0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert quiet.stderr == ""


def test_a_url_without_a_scheme_is_told_to_add_one_not_to_encode_a_password():
    out = cli("runs", url="localhost:6379")
    assert out.returncode == 2
    assert "(no scheme: write redis://localhost:6379/0)" in out.stderr, out.stderr
    assert "percent-encoded" not in out.stderr


def test_timeout_without_wait_is_refused_and_nothing_is_enqueued(r, redis_server):
    for args in (("enqueue", "pool_agents:support", "hi"), ("send", "r_x", "hi")):
        out = cli(*args, "--timeout", "5", url=redis_server.url)
        assert out.returncode == 2, out
        assert "--timeout is how long --wait waits; add --wait, or drop --timeout" in out.stderr
    assert r.zcard(RUNS) == 0


def test_definitions_a_worker_could_not_use_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="names the Claude model to call, e.g. 'claude-sonnet-5-5'; got ''"):
        Agent(model="")

    def lookup(order):
        """Where an order is."""

    with pytest.raises(TypeError, match=r"parameter 'order' has no type annotation; annotate it \(order: str"):
        tool(effect="read")(lookup)

    def search(query: str, *, idempotency_key: str) -> str:
        """Search."""
        return query

    with pytest.raises(TypeError, match="is a read tool but takes 'idempotency_key'.*effect='idempotent'"):
        tool(effect="read")(search)
