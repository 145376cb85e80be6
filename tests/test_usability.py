"""A new user's first hour with the CLI and the API: every mistake answered in one clear line, each
command's output true to what it says (the ledger in call order, each event's own time, what the reaper
did), and the public API importable as documented."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis
from rq.job import Job

import agentpool
from agentpool import enqueue_run, get_run, list_runs, wait_for_run
from agentpool.runtime.jobs import turn_queue
from agentpool.runtime.reaper import STRANDED_AFTER
from agentpool.store.errors import AgentPoolError
from agentpool.store.events import read as read_events
from agentpool.store.keys import RUNS_WATCH, STRANDED, RunKeys
from agentpool.testing.localpool import free_port

from conftest import TESTS, script_task


def agentpool_cli(*args: str, env: dict[str, str] | None = None, url: str | None = None, timeout: float = 300):
    environment = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    environment.update(env or {})
    if url is not None:
        environment["REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "agentpool", *args],
        env=environment,
        cwd=str(TESTS),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


ONE_SHOT_COMMANDS = [
    ("runs",),
    ("enqueue", "pool_agents:support", "task"),
    ("show", "r_x"),
    ("cancel", "r_x"),
    ("approve", "r_x"),
    ("resume", "r_x"),
    ("watch", "r_x"),
    ("worker", "--burst"),
    ("check",),
    ("reap", "--once"),
]


@pytest.mark.parametrize("argv", ONE_SHOT_COMMANDS, ids=" ".join)
def test_an_unreachable_redis_is_one_line_naming_the_url_without_its_password(argv):
    url = f"redis://app:s3cret-pw@127.0.0.1:{free_port()}/0"  # nothing listens there
    out = agentpool_cli(*argv, url=url)

    assert out.returncode == 1, out
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    where = f"redis://app:***@127.0.0.1:{url.rsplit(':', 1)[1]} (from REDIS_URL)"
    assert errors == [f"error: Redis unreachable at {where}: Connection refused"], out.stderr
    assert "Traceback" not in out.stderr and "s3cret-pw" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    "argv", [*ONE_SHOT_COMMANDS, ("worker",), ("metrics", "--port", "1"), ("dashboard",)], ids=" ".join
)
def test_a_malformed_redis_url_names_the_expected_form(argv):
    out = agentpool_cli(*argv, url="localhost:16391")

    assert out.returncode == 2, out
    assert out.stderr.startswith("error: REDIS_URL is not a Redis URL: 'localhost:16391'"), out.stderr
    assert "expected redis://[user:password@]host:port/db, rediss://" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_malformed_url_never_shows_its_password():
    out = agentpool_cli("runs", "--url", "redis://app:s3cret-pw@host:sixthousand/0")
    assert out.returncode == 2 and "--url is not a Redis URL" in out.stderr
    assert "s3cret-pw" not in out.stderr and "app:***@host" in out.stderr


@pytest.mark.parametrize("command, says", [("metrics", "agentpool_redis_up 0"), ("dashboard", "Redis unavailable")])
def test_servers_say_in_one_line_that_redis_is_away_and_keep_serving(command, says, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{free_port()}/0"
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentpool", command, "--port", str(port), "--url", url],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 120

        def warning_line() -> str | None:  # a whole line (written up to its newline), by what it starts with
            whole = log.read_text().rpartition("\n")[0]
            return next((line for line in whole.splitlines() if line.startswith("warning:")), None)

        while (warning := warning_line()) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert proc.poll() is None, "it keeps serving"
        assert warning.startswith(f"warning: Redis unreachable at {url} (from --url): Connection refused; ")
        assert says in warning and "Traceback" not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_runs_refuses_an_unknown_status_listing_the_valid_ones():
    out = agentpool_cli("runs", "--status", "bogus", url="redis://127.0.0.1:1/0")
    assert out.returncode == 2
    for status in ("queued", "running", "waiting_approval", "stopped", "completed", "failed", "cancelled"):
        assert status in out.stderr
    with pytest.raises(ValueError, match="unknown status 'bogus'; valid: cancelled, completed"):
        list_runs(status="bogus", connection=Redis.from_url("redis://127.0.0.1:1/0"))


def test_runs_agent_matches_the_full_path_the_attribute_or_the_module(r, redis_server):
    support = enqueue_run("pool_agents:support", "a", connection=r)
    short = enqueue_run("pool_agents:short", "b", connection=r)
    other = enqueue_run("other_app.agents:support", "c", connection=r, check_agent=False)

    def listed(agent: str) -> set[str]:
        via_api = {run.id for run in list_runs(agent=agent, connection=r)}
        out = agentpool_cli("runs", "--agent", agent, url=redis_server.url)
        assert out.returncode == 0, out.stderr
        assert via_api == {line.split()[0] for line in out.stdout.splitlines()[1:]}
        return via_api

    assert listed("pool_agents:support") == {support}
    assert listed("support") == {support, other}
    assert listed("pool_agents") == {support, short}
    assert listed("other_app") == {other}
    assert listed("pool") == set(), "a module name is matched whole, not as a string prefix"
    help_text = agentpool_cli("runs", "--help").stdout
    assert "--limit" in help_text and "at most" in help_text


SIX_CALLS = [
    {
        "tool_calls": [
            {"name": "read_notes", "input": {"topic": "a"}},
            {"name": "flaky_lookup", "input": {"item": "kettle"}},
            {"name": "read_notes", "input": {"topic": "b"}},
        ]
    },
    {
        "tool_calls": [
            {"name": "create_ticket", "input": {"title": "t", "body": "b"}},
            {"name": "hanging_lookup", "input": {"item": "teapot"}},
            {"name": "send_email", "input": {"to": "x@example.com", "subject": "s", "body": "b"}},
        ]
    },
    {"text": "done"},
]


def test_show_lists_the_ledger_in_call_order_and_its_header_shows_the_cost(r, pool, model):
    model.set_scripts({"six": SIX_CALLS})
    pool.start(1)
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("six"), connection=r), timeout=60, connection=r)
    assert run.status == "completed", run.error

    out = agentpool_cli("show", run.id, url=pool.env["REDIS_URL"])
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0]
    assert f"cost ${run.cost_usd:.4f}" in header and run.cost_usd > 0
    ledger = out.stdout.split("\nledger:\n", 1)[1].splitlines()
    called = [call["name"] for step in SIX_CALLS for call in step.get("tool_calls", [])]
    assert [line.split()[1] for line in ledger] == called


def test_watch_on_a_finished_run_stamps_each_event_with_its_own_time(r, pool, model):
    model.set_scripts({"two": [{"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]}, {"text": "ok"}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("two"), connection=r)
    wait_for_run(run_id, timeout=60, connection=r)

    out = agentpool_cli("watch", run_id, url=pool.env["REDIS_URL"])
    assert out.returncode == 0, out.stderr
    stamps = [line.split()[0] for line in out.stdout.splitlines()[1:-1]]
    expected = []
    for event_id, _ in read_events(r, run_id):
        at = int(event_id.split("-")[0]) / 1000
        expected.append(time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(event_id.split('-')[0]) % 1000:03d}")
    assert stamps == expected and len(set(stamps)) > 1


def test_worker_metrics_port_on_a_busy_port_says_cannot_listen(redis_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = agentpool_cli("worker", "--burst", "--metrics-port", str(port), url=redis_server.url)
    assert out.returncode == 1, out
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_reap_once_says_what_it_did_or_that_there_was_nothing_to_do(r, redis_server):
    run_id = enqueue_run("pool_agents:support", "a task nobody will run", connection=r)
    first_job = r.hget(RunKeys.of(run_id).run, "job").decode()
    Job.fetch(first_job, connection=r).delete()  # a flushed queue, a failover: the job is gone
    r.zadd(RUNS_WATCH, {run_id: 0})  # and the reaper is due to look

    out = agentpool_cli("reap", "--once", url=redis_server.url)
    assert out.returncode == 0, out.stderr
    assert re.search(rf"{run_id}: re-enqueued as {first_job}-r1 \(its job is missing\)", out.stdout), out.stdout
    assert turn_queue(r).get_job_ids() == [f"{first_job}-r1"]

    again = agentpool_cli("reap", "--once", url=redis_server.url)
    assert again.returncode == 0 and again.stdout.startswith("nothing to do"), again.stdout


def test_reap_once_run_twice_gives_back_a_job_stranded_in_between(r, redis_server):
    # A worker killed between its BLMOVE and the claim leaves the turn's job in RQ's intermediate list.
    # The reaper gives it back once it has been seen there STRANDED_AFTER seconds; the sighting is kept
    # in Redis, so two one-shot reapers (two processes) that far apart do it, as a worker's reaper does.
    run_id = enqueue_run("pool_agents:support", "a task nobody will run", connection=r)
    queue = turn_queue(r)
    job = r.hget(RunKeys.of(run_id).run, "job").decode()
    assert r.lmove(queue.key, queue.intermediate_queue_key) == job.encode()  # the dead worker's BLMOVE
    r.hset(STRANDED, "r_long_gone-t0000", 0)  # a sighting of a job no longer listed there

    first = agentpool_cli("reap", "--once", url=redis_server.url)
    assert first.returncode == 0 and "given back" not in first.stdout, first
    assert r.hkeys(STRANDED) == [job.encode()], "the job's sighting kept, the other one dropped"

    time.sleep(STRANDED_AFTER + 0.5)
    second = agentpool_cli("reap", "--once", url=redis_server.url)
    assert second.returncode == 0, second
    assert f"job {job} left in RQ's intermediate queue given back to the queue" in second.stdout, second.stdout
    assert queue.get_job_ids() == [job] and r.llen(queue.intermediate_queue_key) == 0
    assert r.hlen(STRANDED) == 0, "a job given back waits its full time if it is ever stranded again"


def test_a_decode_responses_client_works_like_any_other(r, pool, model, redis_server):
    model.set_scripts({"hi": [{"text": "hello"}]})
    pool.start(1)
    with Redis.from_url(redis_server.url, decode_responses=True) as text_client:
        run_id = enqueue_run("pool_agents:support", script_task("hi"), connection=text_client)
        run = wait_for_run(run_id, timeout=60, connection=text_client)
        assert (run.status, run.result) == ("completed", "hello")
        assert get_run(run_id, connection=text_client).messages == get_run(run_id, connection=r).messages
        assert [x.id for x in list_runs(connection=text_client)] == [run_id]


def test_the_public_errors_are_exported_with_the_api(r):
    exported = {name: getattr(agentpool, name) for name in agentpool.__all__}
    for name in ("RunNotFound", "AgentPoolError", "ApprovalError", "RunTimeout", "InvalidLimit", "ResumeRefused"):
        assert name in exported, name
    errors = [obj for obj in exported.values() if isinstance(obj, type) and issubclass(obj, AgentPoolError)]
    assert all(issubclass(error, AgentPoolError) for error in errors) and len(errors) >= 8
    with pytest.raises(agentpool.RunNotFound):
        get_run("r_nope", connection=r)


def test_metrics_binds_loopback_unless_told_otherwise(redis_server, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentpool", "metrics", "--port", str(port), "--url", redis_server.url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120  # a Python process starting on a loaded machine
        while (bound := _listening_on(port)) is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert bound == "127.0.0.1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _listening_on(port: int) -> str | None:
    """The local address a TCP socket listens on ``port`` with, from /proc/net/tcp."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    return None


@pytest.mark.parametrize(
    "url, secret",
    [
        ("redis://app:Ab3xYz9Q?k+Lm@10.0.0.5:6379/0", "Ab3xYz9Q"),  # "?" in a password not percent-encoded
        ("redis://:Ab3xYz9Q/k+Lm@10.0.0.5:6379/0", "Ab3xYz9Q"),  # "/" likewise: redis-py quotes what precedes it
        ("redis+sentinel://:PWx@h:16398/m?sentinel_password=S&ENTPW", "ENTPW"),  # "&" in a sentinel password
    ],
)
def test_a_password_with_url_syntax_in_it_is_never_shown(url, secret):
    out = agentpool_cli("runs", "--url", url)
    assert out.returncode == 2 and "is not a Redis URL" in out.stderr, out
    assert secret not in out.stdout + out.stderr, out.stderr


@pytest.mark.parametrize(
    "first, retry, differs",
    [
        ({}, {"queue": "urgent"}, "queue"),
        ({"queue": "urgent"}, {}, "queue"),
        ({}, {"webhook": "https://hooks.example.com/x?token=t0k3n"}, "webhook"),
        (
            {"webhook": "https://hooks.example.com/x"},
            {"webhook": "https://hooks.example.com/x", "webhook_events": ("ended", "waiting_approval")},
            "webhook_events",
        ),
        ({}, {"concurrency_key": "acme", "max_concurrency": 1}, "concurrency_key"),
        (
            {"concurrency_key": "acme", "max_concurrency": 1},
            {"concurrency_key": "acme", "max_concurrency": 2},
            "max_concurrency",
        ),
    ],
)
def test_an_enqueue_retried_with_another_queue_webhook_or_concurrency_key_is_refused(r, first, retry, differs):
    """The same run_id is idempotent only for the very same request: a retry told "done" for a run on
    another queue, without its webhook or its cap would believe what is not so."""
    run_id = enqueue_run("pool_agents:support", "t", connection=r, run_id="order-1", **first)
    assert enqueue_run("pool_agents:support", "t", connection=r, run_id="order-1", **first) == run_id, (
        "the same: idempotent"
    )
    before = {key: r.dump(key) for key in (RunKeys.of(run_id).run, RunKeys.of(run_id).messages)}
    with pytest.raises(agentpool.RunExists, match=f"already exists with another {differs};") as refused:
        enqueue_run("pool_agents:support", "t", connection=r, run_id="order-1", **retry)
    assert "t0k3n" not in str(refused.value), "a webhook's URL is not shown"
    assert {key: r.dump(key) for key in before} == before, "nothing was changed"


def test_a_refused_password_is_said_at_once_not_retried_as_an_unreachable_redis(r, redis_server):
    """redis-py's AuthenticationError is a ConnectionError: the API's clients retried a wrong password
    like a Redis restart (12 times, 17 s), then called the server "unreachable"."""
    from redis.exceptions import AuthenticationError

    from agentpool import RedisUnreachable, Shards
    from agentpool.runtime.settings import RedisCredentialsRefused

    r.acl_setuser("app-user", enabled=True, passwords=["+right-pw"], commands=["+@all"], keys=["*"])
    try:
        where = redis_server.url.split("://", 1)[1]  # 127.0.0.1:PORT/0
        url = f"redis://app-user:wrong-pw@{where}"
        for connection in (url, Shards([url])):
            started = time.monotonic()
            with pytest.raises(RedisCredentialsRefused, match="refused the credentials: ") as refused:
                list_runs(connection=connection)
            assert time.monotonic() - started < 2, "not retried"
            assert "wrong-pw" not in str(refused.value)
            assert "127.0.0.1" in str(refused.value), "it names the server"
            assert isinstance(refused.value, RedisUnreachable) and isinstance(refused.value, AuthenticationError)
        with pytest.raises(RedisCredentialsRefused, match=r"Redis at redis://app-user:\*\*\*@127.0.0.1:\d+/0 refused"):
            get_run("r_x", connection=url)
        assert get_run(enqueue_run("pool_agents:support", "t", connection=r), connection=url.replace("wrong", "right"))
    finally:
        r.acl_deluser("app-user")


def test_wait_for_run_returns_when_a_child_run_waits_for_a_person_and_a_timeout_says_why(r, pool, model):
    """A parent waiting_children whose child waits for approval moves only once somebody decides:
    wait_for_run returns then (as for the run's own waiting_approval) instead of waiting out its timeout."""
    from agentpool import approve
    from agentpool.client import RunTimeout

    model.set_scripts(
        {
            "oversee": [
                {"tool_calls": [{"name": "deployer", "input": {"task": "deploy 9 [script:dep]"}}]},
                {"text": "overseen"},
            ],
            "dep": [{"tool_calls": [{"name": "deploy", "input": {"version": "9"}}]}, {"text": "deployed"}],
        }
    )
    idle = enqueue_run("pool_agents:support", "no worker serves this queue", connection=r, queue="nobody")
    with pytest.raises(RunTimeout, match=r"still queued after 0.3 s \(turn 0\): waiting for a worker"):
        wait_for_run(idle, timeout=0.3, connection=r)
    for bad in (float("nan"), None, -1, float("inf"), "60"):
        with pytest.raises(ValueError, match="timeout must be"):
            wait_for_run(idle, timeout=bad, connection=r)

    pool.start(1)
    parent = enqueue_run("subagent_agents:overseer", script_task("oversee"), connection=r)
    started = time.monotonic()
    run = wait_for_run(parent, timeout=120, connection=r)
    assert time.monotonic() - started < 60, "returned when the child asked, not at the timeout"
    (child,) = run.children
    assert run.status == "waiting_children" and run.waiting["waiting_approval"] == [child], run.waiting
    assert get_run(child, connection=r).status == "waiting_approval"
    approve(child, connection=r)
    assert wait_for_run(parent, timeout=120, connection=r).status == "completed"
