"""``agentpool worker --concurrency N``: several turns at once in one threaded worker process, watched
by a supervisor parent that hands a dead worker's turns over at once. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from redis import Redis
from rq.registry import FailedJobRegistry

from agentpool import enqueue_run, wait_for_run
from agentpool.runtime.jobs import turn_queue
from agentpool.store import checkpoint
from agentpool.store.events import read as read_events
from agentpool.testing.localpool import WorkerProcesses, children_of

from conftest import Pool, assert_valid_conversation, script_task

CONCURRENCY = 8


def start_threaded(pool: Pool, name: str, concurrency: int = CONCURRENCY) -> subprocess.Popen[bytes]:
    # No scheduler: its process would outlive a test that SIGKILLs the worker (nothing here defers).
    args = ("--log-level", "INFO", "--concurrency", str(concurrency), "--name", name, "--no-scheduler")
    return WorkerProcesses.start(pool, 1, *args)[0]


def worker_process(supervisor: subprocess.Popen[bytes], *, other_than: int = 0, timeout: float = 120) -> int:
    """The threaded worker forked by ``supervisor`` (a new one, if ``other_than`` is the old one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [pid for pid in children_of(supervisor.pid) if pid != other_than]
        if found:
            return found[0]
        assert supervisor.poll() is None, "the supervisor exited"
        time.sleep(0.02)
    raise AssertionError("the supervisor started no worker process")


def lease_holders(r: Redis) -> list[str]:
    """The worker id ("<name>.<pid>") of every lease held right now."""
    keys = r.keys("ap:{run:*}:lease")
    tokens = [t for t in r.mget(keys) if t] if keys else []
    return [t.decode().split(":", 1)[1] for t in tokens]


def wait_until(predicate, timeout: float, what: str, pool: Pool) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{pool.logs()}")
        time.sleep(0.02)


def takeovers(r: Redis, run_id: str) -> list[dict[str, str]]:
    return [e for _id, e in read_events(r, run_id) if e["kind"] == "takeover"]


SLOW_MODEL = [
    {"delay": 0.5, "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {"delay": 0.5, "text": "Summarized."},
]


def test_many_runs_complete_on_one_process_with_several_turns_in_flight_at_once(r, pool, model):
    model.set_scripts({"slow": SLOW_MODEL})
    supervisor = start_threaded(pool, "threaded-many")
    child = worker_process(supervisor)
    run_ids = [enqueue_run("pool_agents:support", script_task("slow", f"Task {i}"), connection=r) for i in range(24)]

    most_at_once = 0
    holders: set[str] = set()
    while any(checkpoint.load_run(r, rid, with_messages=False).status in ("queued", "running") for rid in run_ids):
        held = lease_holders(r)
        holders.update(held)
        most_at_once = max(most_at_once, len(held))
        assert supervisor.poll() is None, pool.logs()
        time.sleep(0.01)

    assert holders == {f"threaded-many.{child}"}, "every turn ran in the one worker process"
    assert 4 <= most_at_once <= CONCURRENCY, f"{most_at_once} turns in flight at once"
    for run_id in run_ids:
        run = wait_for_run(run_id, timeout=5, connection=r)
        assert run.status == "completed" and run.result == "Summarized.", (run.error, pool.logs())
        assert run.turns == 2
        assert_valid_conversation(run.messages)
    assert Counter(e["tool"] for e in pool.effects())["read_notes"] == len(run_ids)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    assert "lease lost" not in pool.logs(tail=10**6), "no turn lost its lease: none is reported lost"


EMAIL_THEN_SLOW = [
    {
        "tool_calls": [
            {"name": "send_email", "input": {"to": "team@example.com", "subject": "Friday", "body": "Ship it"}},
            {"name": "slow_read", "input": {"seconds": 2.0}},
        ]
    },
    {"text": "Finished."},
]


@pytest.mark.crash
def test_killed_worker_process_has_its_turns_taken_over_by_the_supervisor_at_once(r, pool, model):
    model.set_scripts({"mixed": EMAIL_THEN_SLOW})
    supervisor = start_threaded(pool, "threaded-kill")
    child = worker_process(supervisor)
    run_ids = [enqueue_run("pool_agents:support", script_task("mixed", f"Task {i}"), connection=r) for i in range(6)]
    # Every run is inside slow_read, its send_email done and recorded: the OOM killer strikes.
    wait_until(
        lambda: len({e["run"] for e in pool.effects() if e["tool"] == "slow_read"}) == len(run_ids),
        30,
        "every run to be in slow_read",
        pool,
    )
    os.kill(child, signal.SIGKILL)

    for run_id in run_ids:
        run = wait_for_run(run_id, timeout=60, connection=r)
        assert run.status == "completed" and run.result == "Finished.", (run.error, pool.logs())
        assert_valid_conversation(run.messages)
        kinds = [t["cause_kind"] for t in takeovers(r, run_id)]
        assert kinds == ["horse_death"], f"taken over by the supervisor, not by lease expiry: {kinds}"
        assert str(child) in takeovers(r, run_id)[0]["cause"]
        by_tool = Counter(e["tool"] for e in pool.effects() if e["run"] == run_id)
        assert by_tool["send_email"] == 1, "an unsafe tool is never run twice"
        assert by_tool["slow_read"] == 2, "a read tool interrupted mid-call runs again"

    assert supervisor.poll() is None, "the supervisor outlives its worker"
    assert worker_process(supervisor, other_than=child) != child, "and starts a new one"
    assert lease_holders(r) == []
    # RQ's records as for a killed work horse: the handed-over turns' jobs are gone (`rq info` counts no
    # failure no run had), no job left "started", even after RQ's own cleanup has run.
    turn_queue(r).started_job_registry.cleanup(timestamp=time.time() + 3600)
    assert FailedJobRegistry(queue=turn_queue(r)).count == 0
    assert turn_queue(r).started_job_registry.count == 0
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


SLOW_FIRST_TURN = [
    {"delay": 1.5, "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {"text": "Done after the restart."},
]


def test_sigterm_lets_turns_in_flight_finish_then_the_worker_exits_cleanly(r, pool, model):
    model.set_scripts({"slow": SLOW_FIRST_TURN})
    supervisor = start_threaded(pool, "threaded-term")
    worker_process(supervisor)
    run_ids = [enqueue_run("pool_agents:support", script_task("slow", f"Task {i}"), connection=r) for i in range(4)]
    wait_until(lambda: len(lease_holders(r)) == len(run_ids), 30, "every first turn to be in flight", pool)

    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=60) == 0, pool.logs()

    for run_id in run_ids:
        state = checkpoint.load_run(r, run_id)
        assert (state.status, state.turns, state.phase) == ("running", 1, "model"), "the turn finished and committed"
        assert takeovers(r, run_id) == []
    assert lease_holders(r) == []
    assert FailedJobRegistry(queue=turn_queue(r)).count == 0, "nothing was failed"
    assert turn_queue(r).count == len(run_ids), "the next turns wait in the queue: no new turn was started"

    start_threaded(pool, "threaded-term-2")
    for run_id in run_ids:
        run = wait_for_run(run_id, timeout=60, connection=r)
        assert run.status == "completed" and run.result == "Done after the restart.", (run.error, pool.logs())
        assert_valid_conversation(run.messages)


def test_rq_info_lists_the_threaded_worker_as_busy_with_its_queue(r, pool, model, redis_server):
    model.set_scripts({"slow": SLOW_FIRST_TURN})
    supervisor = start_threaded(pool, "threaded-info")
    child = worker_process(supervisor)
    run_ids = [enqueue_run("pool_agents:support", script_task("slow", f"Task {i}"), connection=r) for i in range(3)]
    wait_until(lambda: len(lease_holders(r)) == len(run_ids), 30, "turns in flight", pool)

    rq_info = [os.path.join(os.path.dirname(sys.executable), "rq"), "info", "-u", redis_server.url]
    out = subprocess.run(rq_info, capture_output=True, text=True, timeout=30, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("threaded-info ")), None)
    assert line is not None, out
    assert f" {child})" in line, "shown with the pid of the process that runs the turns"
    assert "busy" in line and "agentpool" in line, line
    for run_id in run_ids:
        assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
