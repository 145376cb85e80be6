"""A forking worker hands one Redis connection down to its work horses, one after the other, instead of
each horse opening its own (``agentpool.worker.handdown``); a horse that does not end cleanly (here:
SIGKILLed) leaves the worker to close that connection and open another."""

from __future__ import annotations

import os
import signal
import time

import pytest
from redis import Redis

from agentpool import enqueue_run, wait_for_run
from agentpool.store import events
from agentpool.testing.localpool import WorkerProcesses, horses_of

from conftest import Pool, _redis_server, script_task

READ = {"name": "read_notes", "input": {"topic": "release"}}
STEPS = [{"tool_calls": [READ]}, {"tool_calls": [READ]}, {"tool_calls": [READ]}, {"text": "All done."}]
SLOW = [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 3}}]}, {"text": "Slow, but done."}]


def _horses_connections(r: Redis, worker: str) -> list[int]:
    return [int(c["id"]) for c in r.client_list() if c.get("name") == f"{worker}:horses"]


def _completed(r: Redis, run_id: str, pool: WorkerProcesses) -> None:
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.status, run.error, pool.logs())


def test_one_connection_serves_every_horse_of_a_forking_worker(model, tmp_path) -> None:
    # Connections are counted, so this test has a redis-server of its own: on the suite's, a client of an
    # earlier test still winding down (a closing pool, a thread) could open one meanwhile. The leases
    # are renewed every 10 s, not every second, so that no horse's keeper thread wants Redis while its
    # main thread holds the connection (it would open a second one, rightly, and close it as it exits).
    (tmp_path / "redis").mkdir()
    server = _redis_server(tmp_path / "redis").start()
    r = Redis.from_url(server.url)
    pool = Pool(server.url, model, tmp_path)
    try:
        _one_connection_serves_every_horse(r, pool, model)
    finally:
        pool.stop()
        r.close()
        server.stop()


def _one_connection_serves_every_horse(r: Redis, pool: Pool, model) -> None:
    model.set_scripts({"steps": STEPS})
    (worker,) = WorkerProcesses.start(pool, 1, "--name", "hd", AGENTPOOL_LEASE_TTL="30")
    _completed(r, enqueue_run("pool_agents:support", script_task("steps", "first"), connection=r), pool)
    (handed,) = _horses_connections(r, "hd")

    open_before = {c["id"] for c in r.client_list()}
    opened = r.info("stats")["total_connections_received"]
    _completed(r, enqueue_run("pool_agents:support", script_task("steps", "second"), connection=r), pool)
    deadline = time.monotonic() + 10
    while horses_of(worker.pid):  # the last horse has exited: a connection of its own would be closed now
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.02)
    # Four horses, four turns: one connection, the same all along.
    assert _horses_connections(r, "hd") == [handed]
    # And no horse opened one of its own (it would be gone with its horse): every connection opened meanwhile
    # is still open. (On a loaded machine the worker's own threads overlap more, and its pool opens one or
    # two more connections that it keeps; a quiet run opens none.)
    still_open = [c for c in r.client_list() if c["id"] not in open_before]
    assert r.info("stats")["total_connections_received"] - opened == len(still_open), still_open


@pytest.mark.crash
def test_a_horse_killed_mid_turn_leaves_its_connection_closed_not_handed_on(r: Redis, pool, model) -> None:
    model.set_scripts({"steps": STEPS, "slow": SLOW})
    (worker,) = WorkerProcesses.start(pool, 1, "--name", "hd")
    _completed(r, enqueue_run("pool_agents:support", script_task("steps", "warm"), connection=r), pool)
    (handed,) = _horses_connections(r, "hd")

    run_id = enqueue_run("pool_agents:support", script_task("slow", "killed"), connection=r)
    deadline = time.monotonic() + 30
    while not any(f["kind"] == "tool_started" for _, f in events.read(r, run_id)):
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.05)
    (horse,) = horses_of(worker.pid)
    os.kill(horse, signal.SIGKILL)  # mid-tool: whatever it left on its connection, nobody can know
    _completed(r, run_id, pool)

    # The dead horse's connection is closed (the worker's copy too), and the horses after it got a new one.
    now = _horses_connections(r, "hd")
    assert handed not in now and len(now) == 1, (handed, now)
    assert worker.poll() is None, "the worker lives on"
