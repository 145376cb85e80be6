"""A worker cut off from Redis without dying (a TCP proxy between it and Redis stops forwarding, then
resumes): its runs are taken over by another worker once their leases lapse, every write it attempts
afterwards is fenced out, and once the link returns it serves turns again without a restart."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from agentpool import enqueue_run, wait_for_run
from agentpool.store.events import read as read_events
from agentpool.testing.localpool import WorkerProcesses
from agentpool.testing.netfault import NetFault

from conftest import assert_valid_conversation, script_task

pytestmark = pytest.mark.crash

SLOW = [
    {"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]},
    {"tool_calls": [{"name": "send_email", "input": {"to": "a@example.com", "subject": "s", "body": "b"}}]},
    {"text": "All done."},
]


@pytest.fixture
def proxy(redis_server):
    with NetFault.to(redis_server.url) as p:
        yield p


def test_a_partitioned_worker_is_taken_over_fenced_out_and_serves_again_after_the_heal(r, pool, model, proxy):
    model.set_scripts({"slow": SLOW})
    cut = WorkerProcesses.start(
        pool, 1, "--log-level", "INFO", "--name", "cut", "--concurrency", "3", REDIS_URL=proxy.url
    )[0]
    run_ids = [enqueue_run("pool_agents:support", script_task("slow", f"task {i}"), connection=r) for i in range(3)]
    deadline = time.monotonic() + 60
    while len([e for e in pool.effects() if e["tool"] == "slow_read"]) < 3:  # each run mid-tool in `cut`
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.02)

    proxy.partition()
    WorkerProcesses.start(pool, 1, "--log-level", "INFO", "--name", "other")
    runs = [wait_for_run(run_id, timeout=60, connection=r) for run_id in run_ids]
    assert [run.status for run in runs] == ["completed"] * 3, ([run.error for run in runs], pool.logs())
    takeovers = Counter(
        e["cause_kind"] for run_id in run_ids for _, e in read_events(r, run_id) if e["kind"] == "takeover"
    )
    assert takeovers == {"lease_expiry": 3}, takeovers
    before = {run_id: r.xlen(f"ap:{{run:{run_id}}}:events") for run_id in run_ids}
    messages = {run.id: run.messages for run in runs}

    proxy.heal()  # `cut` wakes with three turns whose leases it lost: each write it tries is refused
    deadline = time.monotonic() + 30
    while "lease" not in (log := pool.logs(20000)) or "another worker owns it now" not in log:
        assert time.monotonic() < deadline, "the partitioned worker never noticed it lost its leases:\n" + log
        time.sleep(0.1)
    time.sleep(1)
    for run_id in run_ids:
        after = wait_for_run(run_id, timeout=5, connection=r)
        assert after.messages == messages[run_id], "a fenced-out worker changed a conversation"
        assert r.xlen(f"ap:{{run:{run_id}}}:events") == before[run_id], "a fenced-out write left an event"
        assert_valid_conversation(after.messages)
    emails = Counter(e["run"] for e in pool.effects() if e["tool"] == "send_email")
    assert emails == dict.fromkeys(run_ids, 1), emails
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]

    # Only `cut` is left, the same process as before the partition: it serves new runs.
    pool.kill(pool.procs[1])
    later = [enqueue_run("pool_agents:support", script_task("slow", f"later {i}"), connection=r) for i in range(2)]
    done = [wait_for_run(run_id, timeout=60, connection=r) for run_id in later]
    assert [run.status for run in done] == ["completed"] * 2, (pool.logs(), [run.error for run in done])
    assert cut.poll() is None, "it was not restarted"
