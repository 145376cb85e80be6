"""Priorities: a run's turns stay on its queue (``enqueue_run(..., queue="urgent")``), whatever puts them
back (save point B, a model-error backoff, a takeover after a crash), and ``agentpool worker urgent
default`` serves the queues in that order. Without a queue a run is on ``default``: RQ's queue ``agentpool``."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from redis import Redis

from agentpool import enqueue_run, wait_for_run
from agentpool.runtime.jobs import turn_queue
from agentpool.store import events
from agentpool.store.keys import RUNS, RunKeys
from agentpool.testing.localpool import WorkerProcesses

from conftest import assert_valid_conversation, script_task

READ = {"name": "read_notes", "input": {"topic": "release"}}
STEPS = [{"tool_calls": [READ]}, {"tool_calls": [READ]}, {"text": "All done."}]
OVERLOADED = {"status": 529, "type": "overloaded_error", "message": "Overloaded", "retry_after": 1, "times": 1}


def _start(pool, *queues: str, **env: str):
    return WorkerProcesses.start(pool, 1, *queues, "--log-level", "INFO", **env)[0]


def _event_ids(r: Redis, run_id: str, kind: str) -> list[tuple[int, int]]:
    return [tuple(map(int, i.split("-"))) for i, f in events.read(r, run_id) if f["kind"] == kind]  # type: ignore[misc]


def test_a_worker_serves_its_queues_in_order_and_each_run_stays_on_its_queue(r: Redis, pool, model) -> None:
    model.set_scripts({"steps": STEPS})
    batch = [enqueue_run("pool_agents:support", script_task("steps", f"batch {i}"), connection=r) for i in range(3)]
    urgent = [
        enqueue_run("pool_agents:support", script_task("steps", f"urgent {i}"), connection=r, queue="urgent")
        for i in range(3)
    ]
    assert turn_queue(r).count == 3 and turn_queue(r, "urgent").count == 3  # default stays RQ's "agentpool"
    _start(pool, "urgent", "default")
    runs = {run_id: wait_for_run(run_id, timeout=60, connection=r) for run_id in batch + urgent}
    assert {run.status for run in runs.values()} == {"completed"}, pool.logs()
    for run in runs.values():
        assert run.turns == 3
        assert_valid_conversation(run.messages)
    assert {runs[i].queue for i in urgent} == {"urgent"} and {runs[i].queue for i in batch} == {"default"}
    # Every turn of every urgent run (each next turn goes back to "urgent") ran before any batch turn.
    last_urgent = max(i for run_id in urgent for i in _event_ids(r, run_id, "turn_started"))
    first_batch = min(i for run_id in batch for i in _event_ids(r, run_id, "turn_started"))
    assert last_urgent < first_batch


def test_a_deferred_turn_and_a_taken_over_turn_go_back_to_the_runs_queue(r: Redis, pool, model) -> None:
    model.set_scripts(
        {
            "backoff": [{"error": OVERLOADED, "tool_calls": [READ]}, {"text": "All done."}],
            "crash": STEPS,
        }
    )
    backoff = enqueue_run("pool_agents:support", script_task("backoff"), connection=r, queue="urgent")
    crash = enqueue_run("pool_agents:support", script_task("crash"), connection=r, queue="urgent")
    # A worker that serves "urgent" alone: a turn put back on "default" would never run.
    _start(pool, "urgent", AGENTPOOL_FAULTS="after_save_a")
    for run_id in (backoff, crash):
        run = wait_for_run(run_id, timeout=60, connection=r)
        assert run.status == "completed", (run.status, run.error, pool.logs())
        assert_valid_conversation(run.messages)
    assert any(f["kind"] == "model_error" for _, f in events.read(r, backoff)), "the 529 was never met"
    assert any(f["kind"] == "takeover" for _, f in events.read(r, crash)), "no horse was killed"
    assert turn_queue(r).count == 0


def test_a_bad_queue_name_is_refused_in_one_line_and_makes_nothing(r: Redis, pool) -> None:
    for bad in ("Urgent", "no spaces", "", "a" * 41, "x:y"):
        with pytest.raises(ValueError) as caught:
            enqueue_run("pool_agents:support", "task", connection=r, queue=bad)
        assert "queue name" in str(caught.value) and "\n" not in str(caught.value)
    assert r.zcard(RUNS) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "agentpool", "worker", "--burst", "urgent", "Bad!"],
        env=pool.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "queue name" in proc.stderr and "Bad!" in proc.stderr


def _rq(redis_url: str, *args: str) -> None:
    rq = [sys.executable, "-c", "from rq.cli import main; main()"]
    subprocess.run([*rq, *args, "-u", redis_url], check=True, capture_output=True, timeout=60)


@pytest.mark.parametrize("concurrency", ["1", "2"], ids=["forking", "threaded"])
def test_rq_suspend_holds_every_worker_until_rq_resume(concurrency, r: Redis, redis_server, pool, model) -> None:
    """An operator's `rq suspend`: an idle worker takes no turn (its state says so in `rq info`), and
    `rq resume` lets the queued runs go on."""
    from rq import Worker

    model.set_scripts({"held": [{"text": "Done after the resume."}]})
    _start(pool, "--concurrency", concurrency)
    deadline = time.monotonic() + 30
    while not Worker.all(connection=r):
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.1)
    _rq(redis_server.url, "suspend")
    while not all(w.get_state() == "suspended" for w in Worker.all(connection=r)):
        assert time.monotonic() < deadline, "the idle worker noticed the suspension:\n" + pool.logs()
        time.sleep(0.1)
    run_id = enqueue_run("pool_agents:support", script_task("held"), connection=r)
    time.sleep(3)
    assert r.hget(RunKeys.of(run_id).run, "turns") == b"0" and turn_queue(r).count == 1, "nothing taken"
    _rq(redis_server.url, "resume")
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed" and run.result == "Done after the resume.", (run.error, pool.logs())
