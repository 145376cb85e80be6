"""Crash tests: real worker processes killed with real signals at every window of a turn.

Each fault point SIGKILLs the work horse once per (point, run, turn), as the OOM killer would; the
worker's parent notices the death at once and re-enqueues the turn. Tools count their real executions
in a file outside the system under test.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from agentpool import enqueue_run, get_run, wait_for_run
from agentpool.runtime.jobs import turn_queue
from agentpool.store.events import read as read_events
from agentpool.store.stats import CALL_EVENTS, SPEND_EVENTS
from agentpool.testing import settled_stats
from agentpool.testing.localpool import horses_of

from conftest import assert_valid_conversation, script_task

pytestmark = pytest.mark.crash

# One unsafe call alone in its turn (so "in_tool" catches it), an idempotent one, and an unsafe one
# with a verify hook.
CRASH_SCRIPT = [
    {"tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {
        "tool_calls": [
            {"name": "send_email", "input": {"to": "team@example.com", "subject": "Friday", "body": "Ship it"}}
        ]
    },
    {"tool_calls": [{"name": "create_ticket", "input": {"title": "Changelog", "body": "Ana"}}]},
    {"tool_calls": [{"name": "charge_card", "input": {"amount_cents": 500}}]},
    {"text": "All done."},
]
POINTS = [
    "before_model_call",
    "mid_stream",
    "after_model_reply",
    "after_save_a",
    "in_tool",
    "after_tool_outcome",
    "after_save_b",
]


def _rq_failed_jobs(r, timeout: float = 60) -> int:
    """What `rq info` counts as failed once it has run RQ's cleanup past every dead worker's heartbeat,
    after the workers have finished their bookkeeping: waited for until no job is left started (the
    runs are over), as a cleanup before that (a few ms idle, seconds under load) fails a job a worker
    was still finishing."""
    queue = turn_queue(r)
    deadline = time.monotonic() + timeout
    while started := queue.started_job_registry.get_job_ids():
        assert time.monotonic() < deadline, f"jobs still started with every run over: {started}"
        time.sleep(0.05)
    queue.started_job_registry.cleanup(timestamp=time.time() + 3600)
    while (failed := r.zcard(queue.failed_job_registry.key)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return failed


def _counted_usage(r, run_id: str) -> Counter:
    """What the run's events counted: each call saved (model_responded), each one cut or lost with its
    worker before its save (model_cut), and the rest of a call counted from its note (spend_corrected)."""
    total: Counter = Counter()
    for _id, event in read_events(r, run_id):
        if event["kind"] in SPEND_EVENTS:
            for name in ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
                total[name] += int(event.get(name, 0))
    return total


def kills_at(pool, point: str, run_id: str) -> int:
    return len(list(pool.tmp.glob(f"fault-{point}-{run_id}-*")))


@pytest.mark.parametrize("point", POINTS)
def test_run_survives_a_work_horse_killed_at(point, r, pool, model):
    model.set_scripts({"crash": CRASH_SCRIPT})
    pool.start(2, AGENTPOOL_FAULTS=point)
    run_id = enqueue_run("pool_agents:support", script_task("crash"), connection=r)
    run = wait_for_run(run_id, timeout=90, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    assert run.result == "All done."
    assert run.turns == 5, "turns are counted once per committed model call and never reset"
    assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    assert dict(_counted_usage(r, run_id)) == {k: v for k, v in run.usage.items()}, "usage carried over every resume"
    # Every call the API answered is counted, once: one killed mid-stream or after its reply too (its
    # takeover counts what the call's message_start reported: a model_cut "worker_lost").
    calls = [e for _, e in read_events(r, run_id) if e["kind"] in CALL_EVENTS]
    assert len(calls) == model.stats()["requests"], (calls, model.stats())
    lost = [e for e in calls if e.get("error_type") == "worker_lost"]
    assert len(lost) == (kills_at(pool, point, run_id) if point in ("mid_stream", "after_model_reply") else 0), lost
    inputs = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert all(sum(int(e[name]) for name in inputs) > 0 for e in lost), lost
    kills = kills_at(pool, point, run_id)
    assert kills >= 4, f"the fault point should have fired in most turns, fired {kills}"
    assert _rq_failed_jobs(r) == 0, "a turn handed over is not an RQ failure"

    effects = [e for e in pool.effects() if e["run"] == run_id]
    by_tool = Counter(e["tool"] for e in effects)
    results = {
        b["tool_use_id"]: b
        for m in run.messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
    }
    tool_uses = {
        b["name"]: b["id"]
        for m in run.messages
        if m["role"] == "assistant"
        for b in m["content"]
        if b["type"] == "tool_use"
    }

    # unsafe: never twice
    assert by_tool["send_email"] == 1 and by_tool["charge_card"] == 1
    # idempotent: repeated only with the same key
    assert len({e["key"] for e in effects if e["tool"] == "create_ticket"}) == 1
    if point == "in_tool":
        # killed after the effect, before its outcome was recorded
        assert by_tool["read_notes"] == 2, "a read tool re-runs"
        assert by_tool["create_ticket"] == 2, "an idempotent tool re-runs with the same key"
        email = results[tool_uses["send_email"]]
        assert email.get("is_error") and "status of this send_email call is unknown" in email["content"]
        charge = results[tool_uses["charge_card"]]
        assert not charge.get("is_error") and "confirmed by the processor" in charge["content"]
    else:
        # A read tool's outcome goes into the ledger with save point B: killed after the tool ran and
        # before B, it runs again (a read tool may); every other point finds it recorded or not yet run.
        assert by_tool["read_notes"] == (2 if point == "after_tool_outcome" else 1)
        assert by_tool["create_ticket"] == 1
        assert not any(b.get("is_error") for b in results.values())


def _horses(worker) -> list[int]:
    return horses_of(worker.pid)


SLOW_SCRIPT = [
    {"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]},
    {"tool_calls": [{"name": "send_email", "input": {"to": "a@example.com", "subject": "after", "body": "x"}}]},
    {"text": "Finished."},
]


def test_whole_worker_killed_mid_tool_is_taken_over_after_the_lease_expires(r, pool, model):
    model.set_scripts({"slow": SLOW_SCRIPT})
    first = pool.start(1)[0]
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    effect = pool.wait_for_effect("slow_read")
    assert effect["pid"] in _horses(first)
    pool.kill(first)  # the worker and its horse: a lost machine (how fast: `agentpool bench recovery`)
    pool.start(1)
    run = wait_for_run(run_id, timeout=60, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    takeovers = [e for _, e in read_events(r, run_id) if e["kind"] == "takeover"]
    assert [e["cause_kind"] for e in takeovers] == ["lease_expiry"], takeovers
    assert _rq_failed_jobs(r) == 0, "the dead worker's turn job was taken out of RQ's started registry"
    assert Counter(e["tool"] for e in pool.effects())["send_email"] == 1
    assert Counter(e["tool"] for e in pool.effects())["slow_read"] == 2, "a read tool re-runs"
    assert_valid_conversation(run.messages)


def test_a_horse_dies_with_its_sigkilled_worker_and_its_turn_is_taken_over(r, pool, model):
    """The OOM killer's other choice: the worker, not its horse. Nothing the worker started may run on
    unwatched; the horse is killed with it (PR_SET_PDEATHSIG) and another worker takes the run over."""
    # A tool that outlasts the wait below: a horse left running is still inside it.
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 8}}]}, *SLOW_SCRIPT[1:]]})
    first = pool.start(1)[0]
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    effect = pool.wait_for_effect("slow_read")
    assert effect["pid"] in _horses(first)
    pool.kill(first, with_horse=False)
    deadline = time.monotonic() + 4
    while _alive(effect["pid"]):
        assert time.monotonic() < deadline, "the horse outlived its SIGKILLed worker"
        time.sleep(0.05)
    pool.start(1)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert Counter(e["tool"] for e in pool.effects())["send_email"] == 1
    assert_valid_conversation(run.messages)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_frozen_worker_woken_after_its_lease_expired_writes_nothing(r, pool, model):
    model.set_scripts({"slow": SLOW_SCRIPT})
    frozen = pool.start(1)[0]
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    horse = _horses(frozen)
    pool.kill(frozen, signal.SIGSTOP)  # worker and horse frozen mid-tool, as in a long GC pause
    pool.start(1)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    before = get_run(run_id, connection=r)

    pool.kill(frozen, signal.SIGCONT)  # the zombie wakes: its slow_read returns, its turn must not commit
    # Waited for by what it is (not for a few seconds, which a loaded machine may not give the zombie):
    # the woken horse says it lost the lease and ends its job.
    assert horse, "the frozen worker had a work horse"
    pool.wait_for_log(lambda line: "lost the lease" in line or "lease lost" in line, "saying the horse lost the lease")
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in horse):
        assert time.monotonic() < deadline, "the woken horse never ended its job"
        time.sleep(0.05)
    after = get_run(run_id, connection=r)
    assert after.messages == before.messages and after.turns == before.turns
    assert Counter(e["tool"] for e in pool.effects())["send_email"] == 1
    assert_valid_conversation(after.messages)


@pytest.mark.parametrize(
    ("stop_reason", "ends_as"), [("refusal", "failed"), ("model_context_window_exceeded", "stopped")]
)
def test_a_reply_that_ends_the_run_is_decided_in_save_point_a_itself(stop_reason, ends_as, r, pool, model):
    """Killed right after save point A: the takeover must find the run ended (a refusal fails it; a full
    context window with compaction off stops it, resumably), never settle the reply's tool_use and call
    the model again (a refusal completed with a second call, before)."""
    model.set_scripts(
        {
            "ends": [
                {
                    "text": "I will not do that.",
                    "tool_calls": [
                        {"name": "send_email", "input": {"to": "a@example.com", "subject": "s", "body": "b"}}
                    ],
                    "stop_reason": stop_reason,
                },
                {"text": "Sent anyway."},
            ]
        }
    )
    pool.start(2, AGENTPOOL_FAULTS="after_save_a")
    run_id = enqueue_run("pool_agents:support", script_task("ends"), connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)

    # The run ends in save point A's write; the horse marks its kill an instant after (a busy machine can
    # show the test the ended run first).
    deadline = time.monotonic() + 10
    while not list(pool.tmp.glob(f"fault-after_save_a-{run_id}-*")):
        assert time.monotonic() < deadline, "the horse was killed after save point A"
        time.sleep(0.02)
    assert run.status == ends_as and stop_reason in run.error, (run.status, run.error, pool.logs())
    assert model.stats()["by_script"]["ends"] == 1, "the model was not called again"
    assert run.turns == 1 and not run.pending
    assert_valid_conversation(run.messages)
    closing = run.messages[-1]["content"][0]
    assert closing["type"] == "tool_result" and closing.get("is_error") and "Not executed" in closing["content"]
    assert not [e for e in pool.effects() if e.get("run") == run_id], "no tool of the failed reply ran"


def test_a_work_horse_killed_mid_turn_loses_none_of_the_metrics_its_turn_had_counted(r, pool, model):
    """A horse hands its counters to its worker at each milestone of its turn (its lease, save point A, a
    tool about to run), not only as it ends: the OOM killer taking it inside a tool loses nothing already
    counted. Each turn here is killed once, inside its tool, after its model call was saved."""
    model.set_scripts({"crash": CRASH_SCRIPT})
    pool.start(1, AGENTPOOL_FAULTS="in_tool")
    run_id = enqueue_run("pool_agents:support", script_task("crash"), connection=r)
    run = wait_for_run(run_id, timeout=120, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert kills_at(pool, "in_tool", run_id) >= 4
    pool.stop(signal.SIGTERM)  # a warm stop flushes what the worker holds

    counted = settled_stats(r)
    kinds = Counter(e["kind"] for _, e in read_events(r, run_id))
    assert counted.get("turns") == kinds["turn_started"], (counted, kinds)
    assert sum(v for k, v in counted.items() if k.startswith("tool_calls|")) == kinds["tool_started"]
    for name, used in run.usage.items():
        assert counted.get(f"tokens|kind={name}", 0) == used, (name, counted)
    assert counted.get("cost_usd") == pytest.approx(run.cost_usd)
