"""A connection that goes silent (no FIN, no RST) costs a bounded wait, never a wedged worker.

Two real worker processes (forking, or threaded under their supervisor) reach Redis through ``agentpool.testing.netfault`` in black-hole mode: for
one reply in a hundred (and for a few chosen ones: a dequeue, a lease renewal, save point A, a MULTI),
Redis applies the request, the proxy swallows the answer and leaves that connection open and silent
for good, as a dropped NAT or conntrack entry does. Every client agentpool builds must give up on the
silent socket within its socket timeout, re-send on a new connection (every write is safe to deliver
twice) and go on.
"""

from __future__ import annotations

import time

import pytest
from redis import Redis
from test_delivered_twice import load_scripts, script

from agentpool import enqueue_run, wait_for_run
from agentpool.pricing import price_of
from agentpool.runtime.connections import socket_timeout
from agentpool.runtime.settings import connect
from agentpool.testing import assert_valid_conversation
from agentpool.testing.localpool import WorkerProcesses
from agentpool.testing.netfault import NetFault, resp_command
from agentpool.worker.lean import HEARTBEAT_EVERY

from conftest import Pool, script_task

pytestmark = pytest.mark.crash

PER_CALL = {"input_tokens": 1000, "output_tokens": 100, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
STEPS = [
    # A tool that outlasts a lease renewal period (TTL 3 s in the tests): renewals are sent, and one goes silent.
    {"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}], "usage": PER_CALL},
    {"tool_calls": [{"name": "create_ticket", "input": {"title": "Changelog", "body": "Ana"}}], "usage": PER_CALL},
    {"text": "All done.", "usage": PER_CALL},
]
RUNS = 8
# Generous: with the fix a run ends within its steps plus a few socket timeouts; without it a worker
# waits on a silent socket for RQ's 415 s.
RUN_TIMEOUT = 150


def _successful_jobs(r: Redis) -> dict[str, int]:
    from rq import Worker

    return {w.name: w.successful_job_count for w in Worker.all(connection=r)}


@pytest.mark.parametrize("concurrency", ["1", "3"], ids=["forking", "threaded"])
def test_connections_gone_silent_cost_a_socket_timeout_and_every_run_completes(
    concurrency, r, redis_server, model, tmp_path
):
    names = [f"silent{i}" for i in range(RUNS)]
    model.set_scripts(dict.fromkeys(names, STEPS))
    load_scripts(r)
    with NetFault.to(redis_server.url, black_hole=0.01, seed=7) as proxy:
        # Besides one reply in a hundred at random, the connections of these go silent for sure: a worker's
        # blocking dequeue, the lease keeper's renewal, save point A and an RQ bookkeeping transaction.
        proxy.black_hole_next(resp_command("BLMOVE"), times=2)
        for name in ("lease_renew", "commit_response"):
            proxy.black_hole_next(script(name), times=2)
        proxy.black_hole_next(resp_command("EXEC"), times=2)
        pool = Pool(proxy.url, model, tmp_path)
        try:
            WorkerProcesses.start(pool, 2, "--log-level", "INFO", "--concurrency", concurrency)
            app = connect(proxy.url)  # the app's enqueues go through the silent link too
            runs = {enqueue_run("pool_agents:support", script_task(name), connection=app): name for name in names}
            price = price_of("claude-sonnet-5-5")
            for run_id, name in runs.items():
                run = wait_for_run(run_id, timeout=RUN_TIMEOUT, connection=r)
                assert run.status == "completed", (run_id, run.status, run.error, proxy.black_holed, pool.logs())
                assert_valid_conversation(run.messages)
                calls = model.stats()["by_script"][name]  # every call the model served for this run, paid for
                assert calls >= len(STEPS)
                assert run.usage == {k: v * calls for k, v in PER_CALL.items()}, (run_id, calls, run.usage)
                assert run.cost_usd == pytest.approx(calls * price.cost(PER_CALL))
            assert len(r.keys("ap:{run:*}:run")) == RUNS, "no run was created twice"
            assert proxy.pending_cuts() == 0, "a chosen connection never went silent"
            assert proxy.black_holed > 8, proxy.black_holed

            # No worker is wedged: both are alive and both still take turns. A worker may still be waiting
            # out a dequeue that went silent just before the proxy stopped swallowing replies (up to its
            # socket timeout), while the other takes every turn: runs keep coming until both have taken
            # some, for two socket timeouts and three heartbeats (agentpool.worker.lean adds a worker's
            # jobs to RQ's count with its next heartbeat, every few seconds).
            assert len(pool.alive()) == 2, pool.logs()
            before = _successful_jobs(r)
            proxy.black_hole = 0.0
            deadline = time.monotonic() + 2 * socket_timeout() + 3 * HEARTBEAT_EVERY
            after = _successful_jobs(r)
            while not (len(after) == 2 and all(after[n] > before.get(n, 0) for n in after)):
                if time.monotonic() > deadline:
                    pool.dump_stacks()  # where the idle worker waits, into its log
                    raise AssertionError((before, after, pool.logs(12000)))
                more = [enqueue_run("pool_agents:support", script_task("silent0"), connection=r) for _ in range(6)]
                for run_id in more:
                    assert wait_for_run(run_id, timeout=RUN_TIMEOUT, connection=r).status == "completed", pool.logs()
                time.sleep(0.2)
                after = _successful_jobs(r)
        finally:
            pool.stop()
