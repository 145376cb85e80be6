"""`agentpool demo` keeps its promise (both kills land inside tool calls, nothing lost or repeated); on a
machine where an app already has its Redis it never touches it unless told to, leaves nothing behind
where it is told to, and says what went wrong when something does."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from redis import Redis

from agentpool.testing.localpool import free_port

from conftest import TESTS


def demo(
    *args: str, runs: int = 2, workers: int = 2, timeout: float = 240, **env: str
) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", "agentpool", "demo", "--runs", str(runs), "--workers", str(workers), *args],
        env=environment,
        cwd=str(TESTS),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_demo_leaves_the_apps_redis_alone(r, redis_server):
    r.set("the-apps-own-key", "1")
    out = demo(REDIS_URL=redis_server.url)

    assert out.returncode == 0, out.stdout + out.stderr
    assert "throwaway redis-server" in out.stdout
    # Off a terminal (here a pipe) the live table is not printed again and again: one line per event.
    assert "LAST EVENT" not in out.stdout, out.stdout
    events = re.findall(r"^\d\d:\d\d:\d\d\.\d{3} (r_\w+) +(\w+)", out.stdout, re.MULTILINE)
    assert len({run for run, _kind in events}) == 2 and ("status" in {kind for _run, kind in events}), out.stdout
    # The two runs' events interleaved as they happened, not one run's batch after the other's.
    stamps = re.findall(r"^(\d\d:\d\d:\d\d\.\d{3}) r_", out.stdout, re.MULTILINE)
    assert stamps == sorted(stamps), out.stdout
    assert r.keys("*") == [b"the-apps-own-key"], "nothing enqueued, counted or registered in the app's Redis"


def test_with_redis_url_it_refuses_a_database_in_use_and_wipes_an_empty_one_afterwards(r, redis_server):
    r.set("the-apps-own-key", "1")
    refused = demo("--redis-url", redis_server.url)
    assert refused.returncode == 1
    assert "holds 1 keys; the demo needs an empty one" in refused.stderr, refused.stderr
    assert r.keys("*") == [b"the-apps-own-key"]

    spare = redis_server.url.rsplit("/", 1)[0] + "/5"
    out = demo("--redis-url", spare)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Every run finished" in out.stdout and "keys the demo wrote deleted" in out.stdout
    with Redis.from_url(spare) as borrowed:
        assert borrowed.dbsize() == 0, "the borrowed database is empty again"


def test_when_the_runs_do_not_complete_it_says_which_and_why_with_the_workers_logs():
    unreachable_api = {
        "ANTHROPIC_API_KEY": "sk-test-not-a-secret",
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens: every call fails
        "AGENTPOOL_MODEL_RETRIES": "0",
    }
    out = demo("--real", **unreachable_api)

    assert out.returncode == 1
    assert "2 of 2 runs did not complete:" in out.stderr, out.stderr
    assert out.stderr.count("stopped after 0 turns: the model API failed 1 times in a row") == 2
    assert "worker-0's log" in out.stderr and "SOMETHING WENT WRONG" not in out.stdout + out.stderr

    late = demo("--timeout", "0.5")
    assert late.returncode == 1
    assert "runs still active after 0.5 s" in late.stderr and "2 of 2 runs did not complete" in late.stderr


@pytest.mark.crash
def test_the_demo_kills_a_horse_and_a_worker_inside_tool_calls_and_nothing_is_lost_or_repeated():
    """The README's main command keeps its promise: both kills land inside a tool call, so each leaves a
    turn that another worker takes over (a horse's death seen at once, a lost worker's lease expiring),
    every run completes and the outbox the tools write shows no effect twice."""
    out = demo(runs=8, workers=3)  # the defaults, as the README runs it

    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("inside a tool") == 2, out.stdout
    assert "runs completed:      8/8" in out.stdout, out.stdout
    assert "2 kills, 2 turns taken over (horse_death: 1, lease_expiry: 1)" in out.stdout, out.stdout
    assert "emails sent:         8 for 8 runs, duplicates: 0" in out.stdout, out.stdout
    assert "runs with two tickets: 0" in out.stdout, out.stdout
