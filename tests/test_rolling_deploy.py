"""A rolling deploy with 50 runs in flight: each worker gets its replacement first (started and
registered, as Kubernetes waits for readiness), then SIGTERM (a warm shutdown: its turns in flight
finish). Nothing is lost, no turn is repeated: the scripted model counts its calls per (run, turn)."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import pytest

from agentpool import enqueue_run, wait_for_run
from agentpool.store.events import read as read_events
from agentpool.testing import ScriptRequest
from agentpool.testing.localpool import WorkerProcesses

from conftest import assert_valid_conversation

pytestmark = pytest.mark.crash

RUNS, WORKERS, TURNS = 50, 4, 5


def _longest_wait_for_a_next_turn(r, run_id: str) -> float:
    """Seconds from a turn's commit to the next turn's start, the longest in the run."""
    longest, committed = 0.0, None
    for event_id, fields in read_events(r, run_id):
        at = int(event_id.split("-")[0]) / 1000
        if fields["kind"] == "turn_committed":
            committed = at
        elif fields["kind"] == "turn_started" and committed is not None:
            longest, committed = max(longest, at - committed), None
    return longest


def test_a_rolling_deploy_loses_nothing_and_repeats_no_turn(r, pool, model):
    calls: Counter = Counter()
    lock = threading.Lock()

    def script(request: ScriptRequest) -> dict:
        with lock:
            calls[(request.task, request.step)] += 1
        if request.step == 2:
            to = request.task.split()[-1] + "@example.com"
            return {
                "delay": 0.1,
                "tool_calls": [{"name": "send_email", "input": {"to": to, "subject": "s", "body": "b"}}],
            }
        if request.step < TURNS - 1:
            return {"delay": 0.1, "tool_calls": [{"name": "slow_read", "input": {"seconds": 0.3}}]}
        return {"text": "All done."}

    model.set_scripts({"default": script})
    args = ("--log-level", "INFO", "--concurrency", "4")
    workers = [WorkerProcesses.start(pool, 1, *args, "--name", f"old{i}")[0] for i in range(WORKERS)]
    run_ids = [enqueue_run("pool_agents:support", f"deploy task r{i}", connection=r) for i in range(RUNS)]
    deadline = time.monotonic() + 60
    while len(pool.effects()) < RUNS // 2:  # well under way
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.02)

    for i, old in enumerate(workers):
        name = f"new{i}"
        WorkerProcesses.start(pool, 1, *args, "--name", name)
        deadline = time.monotonic() + 30
        while not r.exists(f"rq:worker:{name}"):
            assert time.monotonic() < deadline, pool.logs()
            time.sleep(0.02)
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=60) == 0, f"worker old{i} did not shut down warm:\n{pool.logs()}"

    runs = [wait_for_run(run_id, timeout=120, connection=r) for run_id in run_ids]
    assert [run.status for run in runs] == ["completed"] * RUNS, [(run.id, run.status, run.error) for run in runs]
    for run in runs:
        assert run.turns == TURNS
        assert_valid_conversation(run.messages)
    repeated = {key: n for key, n in calls.items() if n > 1}
    assert not repeated, f"turns whose model call was made twice: {repeated}"
    assert len(calls) == RUNS * TURNS
    emails = Counter(e["to"] for e in pool.effects() if e["tool"] == "send_email")
    assert len(emails) == RUNS and set(emails.values()) == {1}, emails
    longest = max(_longest_wait_for_a_next_turn(r, run_id) for run_id in run_ids)
    print(f"\nrolling deploy: longest wait for a next turn {longest:.3f} s (lease TTL 3 s in tests)")
