"""A call still in flight when its worker froze or died must not take effect twice: the worker taking
the run over waits until that attempt can no longer be running before it asks ``verify`` or runs
anything, a tool can check that it still owns the call just before its effect, and a dead turn
holder's subprocesses are gone before its turn is handed over. Real workers, real signals; effects
counted in a file outside the pool."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_tool_safety import results_of, start_threaded, worker_process
from test_usability import agentpool_cli

from agentpool import enqueue_run, wait_for_run
from agentpool.store.events import read as read_events
from agentpool.testing.localpool import WorkerProcesses, horses_of

from conftest import Pool, script_task

pytestmark = pytest.mark.crash

MARGIN = {"AGENTPOOL_TAKEOVER_MARGIN": "1"}


def start_worker(pool: Pool):
    """No RQ scheduler anywhere: a deferred turn must not depend on one (a dead worker can hold its lock)."""
    return WorkerProcesses.start(pool, 1, "--log-level", "INFO", "--no-scheduler", **MARGIN)[0]


def wait_for_event(r, run_id: str, wanted, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for _, e in read_events(r, run_id) if wanted(e)]
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no such event for {run_id}: {read_events(r, run_id)}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pay(tool: str) -> list[dict]:
    return [{"tool_calls": [{"name": tool, "input": {"amount_cents": 700}}]}, {"text": "Paid."}]


@pytest.mark.parametrize(
    ("agent", "waited"),
    [("tool_agents:payments", "worker"), ("tool_agents:slow_payments", "deferred")],
    ids=["waits-in-the-worker", "turn-deferred"],
)
def test_a_frozen_workers_charge_is_not_made_again_by_the_worker_that_takes_over(
    r, pool, model, redis_server, agent, waited
):
    model.set_scripts({"pay": pay("slow_charge")})
    frozen = start_worker(pool)
    run_id = enqueue_run(agent, script_task("pay"), connection=r)
    pool.wait_for_effect("slow_charge_started")
    horse = horses_of(frozen.pid)
    pool.kill(frozen, signal.SIGSTOP)  # inside the payment API call, before the charge: a long GC pause
    # The case under test is a takeover that comes while the frozen attempt may still be running (one
    # that comes after start + timeout + margin is ensure_owned's, below). A margin of 8 s keeps it so
    # however slowly the new worker starts on a loaded machine; its lease TTL puts that wait in the
    # worker (a wait up to one TTL) or defers the turn (a longer one), whichever this case is about.
    WorkerProcesses.start(
        pool,
        1,
        "--log-level",
        "INFO",
        "--no-scheduler",
        AGENTPOOL_TAKEOVER_MARGIN="8",
        AGENTPOOL_LEASE_TTL="30" if waited == "worker" else "3",
    )
    try:
        # The frozen worker wakes once the new one has decided about the call in flight. Without the wait,
        # it has asked verify ("not happened") and started its own charge with the same key by then.
        wait_for_event(
            r,
            run_id,
            lambda e: e["kind"] == "waiting_for_attempt" or (e["kind"] == "tool_started" and e["attempt"] == "2"),
        )
    finally:
        pool.kill(frozen, signal.SIGCONT)
    run = wait_for_run(run_id, timeout=60, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    charges = [e for e in pool.effects() if e["tool"] == "slow_charge"]
    assert len(charges) == 1, f"charged {len(charges)} times with the same key: {charges}"
    assert charges[0]["pid"] in horse, "the frozen worker's attempt is the one that charged"
    (result,) = results_of(run)
    assert "confirmed by the processor" in result["content"], "verify was asked once that attempt was over"
    waits = [e for _, e in read_events(r, run_id) if e["kind"] == "waiting_for_attempt"]
    assert [e["where"] for e in waits] == [waited], waits
    if waited == "deferred":  # `watch` shows when the deferred turn is due on its lines' own clock
        (until,) = [float(e["until"]) for _, e in read_events(r, run_id) if e["kind"] == "waiting_for_call"]
        watched = agentpool_cli("watch", run_id, "--events-only", url=redis_server.url)
        (line,) = [line for line in watched.stdout.splitlines() if " waiting_for_call " in line]
        clock = time.strftime("%H:%M:%S", time.localtime(until)) + f".{int(until * 1000) % 1000:03d}"
        assert line.endswith(f"waiting_for_call   until={clock}"), line


def test_a_tool_checking_ownership_before_its_effect_stops_in_a_worker_frozen_past_the_wait(r, pool, model):
    model.set_scripts({"pay": pay("careful_charge")})
    frozen = start_worker(pool)
    run_id = enqueue_run("tool_agents:payments", script_task("pay"), connection=r)
    pool.wait_for_effect("careful_charge_started")
    horse = horses_of(frozen.pid)
    pool.kill(frozen, signal.SIGSTOP)
    start_worker(pool)
    try:
        # Frozen longer than the tool's timeout + margin: the new worker waited that out, was told
        # "not happened" by verify, and charged; the run is over.
        run = wait_for_run(run_id, timeout=60, connection=r)
    finally:
        pool.kill(frozen, signal.SIGCONT)  # the old attempt wakes right before its charge
    assert run.status == "completed", (run.error, pool.logs())
    # Woken, the old attempt either reaches its effect, where ensure_owned refuses it, or its work horse
    # exits first (its turn gave up on the call: the horse ends, and the tool's thread with it); which of
    # the two comes first is a race. Either way it never charges. (ensure_owned's refusal on its own:
    # tests/test_reconcile.py.)
    deadline = time.monotonic() + 60
    while not (refused := [e for e in pool.effects() if e["tool"] == "careful_charge_refused"]):
        if not any(alive(pid) for pid in horse):
            break
        assert time.monotonic() < deadline, "the woken attempt neither refused nor ended"
        time.sleep(0.02)
    charges = [e for e in pool.effects() if e["tool"] == "careful_charge"]
    assert len(charges) == 1 and charges[0]["pid"] not in horse, charges
    for one in refused:
        assert one["pid"] in horse and one["attempt"] == 1 and one["key"] == charges[0]["key"], one


@pytest.mark.parametrize("kind", ["threaded", "forking"])
def test_a_dead_turn_holders_subprocess_is_gone_before_its_turn_is_handed_over(r, pool, model, kind):
    model.set_scripts(
        {"report": [{"tool_calls": [{"name": "run_report", "input": {"name": "q3"}}]}, {"text": "Reported."}]}
    )
    if kind == "threaded":
        supervisor = start_threaded(pool, "reports")
        victim = worker_process(supervisor)
    else:
        victim = 0
        worker = pool.start(1)[0]
    run_id = enqueue_run("tool_agents:misbehaving", script_task("report"), connection=r)
    child = pool.wait_for_effect("run_report")["child"]  # it ignores SIGTERM, in its parent's process group
    beats = _wait_for_beats(pool, child)
    try:
        victim = victim or horses_of(worker.pid)[0]
        os.kill(victim, signal.SIGKILL)  # the OOM killer takes the process that ran the tool
        _assert_stopped_before_the_hand_over(r, pool, run_id, beats, "horse_death")
        assert not alive(child)
    finally:
        _kill_if_alive(child)


def _wait_for_beats(pool: Pool, child: int) -> Path:
    """The file the report subprocess ``child`` writes the time to every 10 ms, once it exists."""
    beats = pool.tmp / f"beats-{child}"
    deadline = time.monotonic() + 60
    while not beats.exists():
        assert time.monotonic() < deadline, "the report subprocess never started"
        time.sleep(0.01)
    return beats


def _assert_stopped_before_the_hand_over(r, pool: Pool, run_id: str, beats: Path, cause: str) -> None:
    """The run completes after one takeover for ``cause``, and the subprocess's last beat came before
    the turn was enqueued for the next holder."""
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    (takeover,) = [e for _, e in read_events(r, run_id) if e["kind"] == "takeover"]
    assert takeover["cause_kind"] == cause, takeover
    enqueued_at = float(takeover["queued_at"])  # taken just before the job went onto the queue
    last_beat = float(beats.read_text())
    assert last_beat < enqueued_at, f"the subprocess ran {last_beat - enqueued_at:.3f} s past the hand-over"


def _kill_if_alive(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_tool_subprocess_dies_with_its_horse_when_the_whole_worker_is_sigkilled(r, pool, model):
    """The OOM killer takes the worker itself: its horse dies with it (PR_SET_PDEATHSIG) and takes its
    process group along, so a tool's SIGTERM-proof subprocess stops before anyone else holds the turn."""
    model.set_scripts(
        {"report": [{"tool_calls": [{"name": "run_report", "input": {"name": "q3"}}]}, {"text": "Reported."}]}
    )
    worker = pool.start(1)[0]
    run_id = enqueue_run("tool_agents:misbehaving", script_task("report"), connection=r)
    child = pool.wait_for_effect("run_report")["child"]
    beats = _wait_for_beats(pool, child)
    try:
        pool.kill(worker, with_horse=False)  # the worker alone: nobody is left to end the horse's group
        deadline = time.monotonic() + 30  # a bound on a hang: the order is checked on the beats below
        while alive(child):
            assert time.monotonic() < deadline, "the tool's subprocess outlived its SIGKILLed worker and horse"
            time.sleep(0.02)
        pool.start(1)
        _assert_stopped_before_the_hand_over(r, pool, run_id, beats, "lease_expiry")
    finally:
        _kill_if_alive(child)
