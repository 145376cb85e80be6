"""A crash costs its run the takeover's seconds, not the queue's length.

A turn that was already running when its worker died goes back to the FRONT of the queue (RQ's
``at_front``), ahead of the backlog that queued behind it meanwhile, and so does a hand-back whose
backoff ended: both had waited their place once. Real workers, real SIGKILLs; the order of events is
asserted, never a time.
"""

from __future__ import annotations

import time

import pytest

from agentpool import enqueue_run, wait_for_run
from agentpool.runtime.reaper import reap_once
from agentpool.store.events import read as read_events

from conftest import assert_valid_conversation, script_task

pytestmark = pytest.mark.crash

BACKLOG = 6
BACKLOG_STEPS = [{"text": "Backlog done."}]


def _stream_id(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq)


def _first_after(r, run_id: str, kinds: tuple[str, ...], after: str = "0-0") -> str:
    """The id of the run's first event of ``kinds`` after event ``after``."""
    for event_id, event in read_events(r, run_id):
        if _stream_id(event_id) > _stream_id(after) and event["kind"] in kinds:
            return event_id
    raise AssertionError(f"run {run_id} has no {kinds} event after {after}")


def _enqueue_crash_then_backlog(r, crash_script: str) -> tuple[str, list[str]]:
    """The run to crash first, then the backlog, all queued before any worker starts: the crashed run's
    turn is dequeued first, and the backlog is still waiting when it is re-enqueued."""
    victim = enqueue_run("pool_agents:support", script_task(crash_script, "the run that crashes"), connection=r)
    backlog = [
        enqueue_run("pool_agents:support", script_task("backlog", f"queued work {i}"), connection=r)
        for i in range(BACKLOG)
    ]
    return victim, backlog


def _assert_resumed_ahead_of_the_backlog(r, victim: str, backlog: list[str], cause_kind: str) -> None:
    for run_id in [victim, *backlog]:
        run = wait_for_run(run_id, timeout=90, connection=r)
        assert run.status == "completed", (run_id, run.status, run.error)
        assert_valid_conversation(run.messages)
    takeovers = [(i, e) for i, e in read_events(r, victim) if e["kind"] == "takeover"]
    assert [e["cause_kind"] for _i, e in takeovers] == [cause_kind], takeovers
    # A turn that takes over says "resumed" where a fresh one says "turn_started".
    resumed = _first_after(r, victim, ("resumed", "turn_started"), after=takeovers[0][0])
    started = {run_id: _first_after(r, run_id, ("turn_started",)) for run_id in backlog}
    later = {run_id: at for run_id, at in started.items() if _stream_id(at) > _stream_id(resumed)}
    assert later == started, f"the crashed run resumed at {resumed}, behind backlog turns started at {started}"


def test_a_turn_whose_work_horse_was_killed_goes_ahead_of_the_backlog(r, pool, model):
    # The horse is SIGKILLed inside the crashed run's tool (the fault point fires once per run and turn;
    # the backlog's runs call no tool): the worker re-enqueues the turn at once, with six turns waiting.
    model.set_scripts(
        {
            "crash": [{"tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]}, {"text": "Done."}],
            "backlog": BACKLOG_STEPS,
        }
    )
    victim, backlog = _enqueue_crash_then_backlog(r, "crash")
    pool.start(1, AGENTPOOL_FAULTS="in_tool")
    _assert_resumed_ahead_of_the_backlog(r, victim, backlog, "horse_death")


def test_a_turn_taken_over_by_the_reaper_goes_ahead_of_the_backlog(r, pool, model):
    # The whole worker (and its horse) is SIGKILLed mid-tool; the reaper re-enqueues the turn once the
    # lease lapses, and only then does a new worker start, with the backlog still queued.
    model.set_scripts(
        {
            "slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 4}}]}, {"text": "Done."}],
            "backlog": BACKLOG_STEPS,
        }
    )
    victim, backlog = _enqueue_crash_then_backlog(r, "slow")
    worker = pool.start(1, AGENTPOOL_REAPER_INTERVAL="0")[0]
    pool.wait_for_effect("slow_read")
    pool.kill(worker)
    deadline = time.monotonic() + 30
    while victim not in reap_once(r):  # the reaper's own code, run here: no worker is alive
        assert time.monotonic() < deadline, "the reaper never took the run over"
        time.sleep(0.1)
    pool.start(1)
    _assert_resumed_ahead_of_the_backlog(r, victim, backlog, "lease_expiry")
