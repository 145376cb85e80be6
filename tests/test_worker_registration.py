"""What `rq info` says about agentpool's workers: how long a dead one stays listed, and a live one whose
RQ record expired (Redis out of reach longer than its TTL) listed again. Real workers, real `rq info`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agentpool import enqueue_run, wait_for_run
from agentpool.testing.localpool import WorkerProcesses

from conftest import script_task

SLOW = [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 6}}]}, {"text": "Done."}]
RECORD_TTL = 90  # docs/cli.md: a worker killed whole stays listed up to about 90 s


def start(pool, kind: str, name: str):
    threads = ("--concurrency", "2") if kind == "threaded" else ()
    return WorkerProcesses.start(pool, 1, "--log-level", "INFO", "--name", name, "--no-scheduler", *threads)[0]


def rq_info_line(url: str, name: str) -> str | None:
    """The worker's line in `rq info`, or None if it does not list it."""
    rq = os.path.join(os.path.dirname(sys.executable), "rq")
    out = subprocess.run([rq, "info", "-u", url], capture_output=True, text=True, timeout=30, check=True).stdout
    return next((line for line in out.splitlines() if line.startswith(f"{name} ")), None)


def wait_listed(url: str, name: str, state: str, pool, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        line = rq_info_line(url, name)
        if line is not None and f": {state} " in line and "agentpool" in line:
            return line
        assert time.monotonic() < deadline, f"rq info lists {name} as {line!r}, not {state}\n{pool.logs()}"
        time.sleep(0.5)


@pytest.mark.parametrize("kind", ["forking", "threaded"])
def test_a_workers_rq_record_outlives_its_last_heartbeat_by_90_seconds_at_most(kind, r, pool, model, redis_server):
    """RQ's default worker TTL (420 s, so 480 s past a heartbeat) listed a worker killed whole as busy
    for 8 minutes; the record must say within 90 s, idle and busy alike."""
    model.set_scripts({"slow": SLOW})
    name = f"ttl-{kind}"
    start(pool, kind, name)
    key = f"rq:worker:{name}"
    wait_listed(redis_server.url, name, "idle", pool)
    ttls = [r.ttl(key)]
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    for _ in range(6):  # the tool runs: the worker's heartbeats while busy
        ttls.append(r.ttl(key))
        time.sleep(1)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed", pool.logs()
    ttls.append(r.ttl(key))
    assert all(0 < ttl <= RECORD_TTL for ttl in ttls), ttls


@pytest.mark.parametrize("lost", ["expired", "restarted"])
@pytest.mark.parametrize("kind", ["forking", "threaded"])
def test_a_worker_whose_rq_record_was_lost_is_listed_by_rq_info_again(kind, lost, r, pool, model, redis_server):
    model.set_scripts({"slow": SLOW})
    name = f"again-{kind}"
    start(pool, kind, name)
    key = f"rq:worker:{name}"
    wait_listed(redis_server.url, name, "idle", pool)
    birth = r.hget(key, "birth")
    if lost == "expired":
        # What an outage longer than the record's TTL leaves: the record gone, and RQ's cleanup of its
        # worker sets (which `rq info` runs) has dropped the worker from them.
        r.delete(key)
        r.srem("rq:workers", key)
        r.srem("rq:workers:agentpool", key)
    else:
        redis_server.stop(signal.SIGKILL)  # it keeps nothing on disk: it comes back empty
        redis_server.start()
    assert rq_info_line(redis_server.url, name) is None

    line = wait_listed(redis_server.url, name, "idle", pool, timeout=40)  # the threaded worker beats every 15 s
    assert r.hget(key, "birth") == birth, "written again as it was, not as a new worker"
    assert 0 < r.ttl(key) <= RECORD_TTL, line
    pool.wait_for_log(lambda text: name in text and "registered again" in text, "saying the record was written again")

    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    wait_listed(redis_server.url, name, "busy", pool)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed", pool.logs()


@pytest.mark.crash
def test_a_worker_killed_whole_mid_turn_leaves_rq_info_within_90_seconds(r, pool, model, redis_server):
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 30}}]}, {"text": "Done."}]})
    doomed = start(pool, "forking", "doomed")
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    wait_listed(redis_server.url, "doomed", "busy", pool)
    pool.kill(doomed)  # the worker and its horse: a lost machine
    killed = time.monotonic()
    start(pool, "forking", "heir")
    assert wait_for_run(run_id, timeout=120, connection=r).status == "completed", pool.logs()

    while rq_info_line(redis_server.url, "doomed") is not None:
        assert time.monotonic() - killed < RECORD_TTL + 10, "rq info still lists the dead worker"
        time.sleep(2)
    assert rq_info_line(redis_server.url, "heir") is not None


@pytest.mark.parametrize("kind", ["forking", "threaded"])
def test_check_worker_is_ready_once_this_machines_worker_is_registered_and_not_once_it_is_gone(
    kind, r, pool, model, redis_server, tmp_path
):
    """A readiness probe for a worker's pod: `agentpool check` says Redis answers, which it does long
    before the worker has registered (and after it died); `check --worker` says the worker took its
    place in the pool."""
    ready_dir = {"AGENTPOOL_READY_DIR": str(tmp_path / "ready")}

    def check_worker() -> subprocess.CompletedProcess[str]:
        return pool.cli("check", "--worker", timeout=30, **ready_dir)

    before = check_worker()
    assert before.returncode == 1 and "no worker of this machine is registered" in before.stderr, before
    threads = ("--concurrency", "2") if kind == "threaded" else ()
    (worker,) = WorkerProcesses.start(pool, 1, "--name", f"ready-{kind}", "--no-scheduler", *threads, **ready_dir)
    deadline = time.monotonic() + 60
    while (up := check_worker()).returncode != 0:
        assert time.monotonic() < deadline, (up.stderr, pool.logs())
        time.sleep(0.3)
    assert up.stdout.strip() == "ok" and r.exists(f"rq:worker:ready-{kind}")
    pool.kill(worker)  # SIGKILL: its RQ record stays behind for a while, its note too
    assert r.exists(f"rq:worker:ready-{kind}")
    gone = check_worker()
    assert gone.returncode == 1 and "no worker of this machine is registered" in gone.stderr, gone
    assert list((tmp_path / "ready").iterdir()) == [], "the dead worker's note was removed"


def test_a_killed_workers_readiness_note_goes_when_the_next_worker_starts_without_any_probe(pool, tmp_path):
    """A machine nobody probes (no `check --worker`) must not keep a note for every worker ever killed."""
    ready_dir = {"AGENTPOOL_READY_DIR": str(tmp_path / "ready")}

    def notes() -> list[str]:
        return sorted(p.name for p in (tmp_path / "ready").glob("*.json"))

    def wait_for(count: int, why: str) -> None:
        deadline = time.monotonic() + 60
        while len(notes()) != count:
            assert time.monotonic() < deadline, (why, notes(), pool.logs())
            time.sleep(0.2)

    (first,) = WorkerProcesses.start(pool, 1, "--name", "noted-1", "--no-scheduler", **ready_dir)
    wait_for(1, "the first worker noted itself")
    dead = notes()
    pool.kill(first)  # SIGKILL: it cannot drop its note
    assert notes() == dead
    WorkerProcesses.start(pool, 1, "--name", "noted-2", "--no-scheduler", **ready_dir)
    deadline = time.monotonic() + 60
    while len(notes()) != 1 or notes() == dead:
        assert time.monotonic() < deadline, ("only the living worker's note is left", notes(), pool.logs())
        time.sleep(0.2)
