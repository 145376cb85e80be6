"""Fair shares: ``enqueue_run(..., concurrency_key="acme", max_concurrency=N)`` keeps at most N turns of
the key in flight across the pool; the others wait holding no worker, in line, and the turn that frees a
slot wakes the first waiter. An operator's ``agentpool limits set acme N`` wins over the runs' own."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from redis import Redis

from agentpool import cancel_run, enqueue_run, wait_for_run
from agentpool.runtime.jobs import turn_queue
from agentpool.runtime.reaper import reap_once
from agentpool.runtime.takeover import MAX_TURN_ATTEMPTS
from agentpool.runtime.turn import run_turn
from agentpool.store import concurrency, events, lease
from agentpool.store.keys import RUNS, RUNS_WATCH, TURNS_DEFERRED, ConcurrencyKeys, RunKeys
from agentpool.testing.localpool import WorkerProcesses

from conftest import assert_valid_conversation, script_task

WORK = {"name": "timed_work", "input": {"seconds": 0.4}}
STEPS = [{"tool_calls": [WORK]}, {"tool_calls": [WORK]}, {"text": "All done."}]


def _hold(r: Redis, run_id: str, token: str) -> None:
    r.set(RunKeys.of(run_id).lease, token)  # the turn holding the run's lease


def test_slots_are_granted_up_to_the_limit_then_in_line_and_a_dead_holders_slot_frees(r: Redis) -> None:
    for run_id in ("a", "b", "c", "d"):
        _hold(r, run_id, f"1:{run_id}")
    assert concurrency.acquire(r, "acme", "a", 2, "1:a").granted
    assert concurrency.acquire(r, "acme", "b", 2, "1:b").granted
    assert not concurrency.acquire(r, "acme", "c", 2, "1:c").granted
    assert not concurrency.acquire(r, "acme", "d", 2, "1:d").granted
    keys = ConcurrencyKeys.of("acme")
    concurrency.stage_wake(r, "acme", "c", "c:1:1", 10**13)  # type: ignore[arg-type]
    r.zadd(TURNS_DEFERRED, {"c:1:1": 10**13})
    # a's turn ends: its slot frees and c, first in line, is woken (its deferred turn is due now).
    assert concurrency.release(r, "acme", "a", "1:a")
    assert r.zscore(TURNS_DEFERRED, "c:1:1") < 10**13
    assert not concurrency.acquire(r, "acme", "d", 2, "1:d").granted  # c is ahead of d
    assert concurrency.acquire(r, "acme", "c", 2, "1:c").granted
    # b's worker dies: once b's lease is gone (or taken by the next owner) its slot is free.
    r.set(RunKeys.of("b").lease, "2:other-worker")
    assert concurrency.acquire(r, "acme", "d", 2, "1:d").granted
    assert r.zcard(keys.waiting) == 0


def test_a_long_line_for_a_slot_costs_a_turn_a_few_reads_and_nobody_overtakes(r: Redis) -> None:
    """A big tenant's thousand runs wait in its key's line. A turn reads the line from its head only
    until the waiters read take the slots left, and counts those it did not read as ahead of it: so
    putting 1,000 in line reads a few waiters each, where reading every waiter ahead made it a million
    reads; a run is still granted only once no live waiter ahead of it would be left without a slot."""
    runs = ["holder", *(f"w{i:04d}" for i in range(1000)), "newcomer"]
    for run_id in runs:
        _hold(r, run_id, f"1:{run_id}")
    assert concurrency.acquire(r, "big", "holder", 2, "1:holder").granted
    r.config_resetstat()
    line = [concurrency.acquire(r, "big", run_id, 2, f"1:{run_id}") for run_id in runs[1:-1]]
    reads = r.info("commandstats")["cmdstat_hget"]["calls"]
    assert [slot.granted for slot in line] == [True] + [False] * 999  # the second slot, then the line
    assert reads <= 2 * 1000, f"{reads} waiters read to put 1,000 in line"
    assert line[-1].ahead == 998 and line[1].ahead == 0
    assert not concurrency.acquire(r, "big", "newcomer", 2, "1:newcomer").granted
    concurrency.release(r, "big", "holder", "1:holder")  # one slot free: w0001's, first in line
    assert not concurrency.acquire(r, "big", "w0500", 2, "1:w0500").granted, "a waiter went ahead of 499"
    assert not concurrency.acquire(r, "big", "newcomer", 2, "1:newcomer").granted
    assert concurrency.acquire(r, "big", "w0001", 2, "1:w0001").granted


def test_an_operator_limit_wins_over_the_runs_own(r: Redis) -> None:
    for run_id in ("a", "b"):
        _hold(r, run_id, f"1:{run_id}")
    concurrency.set_limit(r, "acme", 1)
    assert concurrency.acquire(r, "acme", "a", 5, "1:a").granted
    assert not concurrency.acquire(r, "acme", "b", 5, "1:b").granted
    concurrency.set_limit(r, "acme", None)
    assert concurrency.acquire(r, "acme", "b", 5, "1:b").granted


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_key_never_has_more_turns_in_flight_than_its_limit_and_a_small_tenant_is_not_starved(
    r: Redis, pool, model
) -> None:
    model.set_scripts({"steps": STEPS})
    big = [
        enqueue_run(
            "pool_agents:support",
            script_task("steps", f"big {i}"),
            connection=r,
            concurrency_key="big",
            max_concurrency=2,
        )
        for i in range(6)
    ]
    small = enqueue_run(
        "pool_agents:support", script_task("steps", "small"), connection=r, concurrency_key="small", max_concurrency=2
    )
    WorkerProcesses.start(pool, 1, "--concurrency", "6", "--log-level", "INFO")
    runs = {run_id: wait_for_run(run_id, timeout=120, connection=r) for run_id in [*big, small]}
    assert {run.status for run in runs.values()} == {"completed"}, pool.logs()
    for run in runs.values():
        assert run.turns == 3
        assert_valid_conversation(run.messages)
    worked = [e for e in pool.effects() if e["tool"] == "timed_work"]
    by_big = [(e["started"], e["ended"]) for e in worked if e["run"] in big]
    # Six threads, six runs: without the key's limit the six would work at once.
    assert _most_at_once(by_big) <= 2
    waits = [f for run_id in big for _, f in events.read(r, run_id) if f["kind"] == "waiting_for_slot"]
    assert waits, "no turn of the big tenant ever waited"
    # The small tenant's run did not wait behind the big one's: it was done before the big one was.
    small_done = max(e["ended"] for e in worked if e["run"] == small)
    assert small_done < max(end for _, end in by_big)


def test_bad_concurrency_arguments_are_refused_in_one_line_and_make_nothing(r: Redis, pool) -> None:
    for kwargs, words in [
        ({"concurrency_key": "acme", "max_concurrency": 0}, "max_concurrency"),
        ({"concurrency_key": "acme", "max_concurrency": float("nan")}, "max_concurrency"),
        ({"max_concurrency": 3}, "concurrency_key"),
        ({"concurrency_key": "a b", "max_concurrency": 3}, "concurrency key"),
    ]:
        with pytest.raises(ValueError) as caught:
            enqueue_run("pool_agents:support", "task", connection=r, **kwargs)  # type: ignore[arg-type]
        assert words in str(caught.value) and "\n" not in str(caught.value)
    assert r.zcard(RUNS) == 0
    cli = [sys.executable, "-m", "agentpool", "limits"]
    done = subprocess.run([*cli, "set", "acme", "3"], env=pool.env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    shown = subprocess.run([*cli, "show"], env=pool.env, capture_output=True, text=True, check=False)
    assert [line.split() for line in shown.stdout.splitlines() if line.startswith("acme")] == [["acme", "3", "0", "0"]]
    bad = subprocess.run([*cli, "set", "acme", "-1"], env=pool.env, capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "-1" in bad.stderr


def test_a_turn_that_waits_for_its_slot_many_times_is_not_failed_as_a_crash_loop(r: Redis, redis_server, monkeypatch):
    """A wait is not a crash. A tenant's turn deferred for its slot more often than a turn may be cut
    short (``MAX_TURN_ATTEMPTS``), then repaired once by the reaper (its job lost from the queue), goes
    on: each wait used to count as a start cut short, and that repair failed a healthy run."""
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    holder = enqueue_run(
        "pool_agents:support", "holds the slot", connection=r, concurrency_key="acme", max_concurrency=1
    )
    held = lease.acquire(r, RunKeys.of(holder), turn=0, worker_id="w.1", ttl_ms=600_000)
    assert concurrency.acquire(r, "acme", holder, 1, held.token).granted
    waiter = enqueue_run("pool_agents:support", "waits", connection=r, concurrency_key="acme", max_concurrency=1)
    for _ in range(MAX_TURN_ATTEMPTS + 5):
        assert run_turn(waiter, 0) == "deferred"  # as its job would, each time its wait is up
    assert r.hget(RunKeys.of(waiter).run, "attempt") == b"0"
    # The slot frees and the deferred turn is enqueued; then its job is lost (a flushed queue, a
    # failover that lost the push) and the reaper, finding the run with no job, repairs it.
    lease.release(r, RunKeys.of(holder), held.token)
    r.zremrangebyrank(TURNS_DEFERRED, 0, -2)  # the earlier waits' entries, which their jobs would have taken
    r.zadd(TURNS_DEFERRED, dict.fromkeys(r.zrange(TURNS_DEFERRED, 0, -1), 0))
    reap_once(r)
    job = r.hget(RunKeys.of(waiter).run, "job")
    assert r.lrem(turn_queue(r).key, 0, job) == 1
    r.zadd(RUNS_WATCH, {waiter: 0})
    assert reap_once(r) == [waiter]
    status, error, attempt = r.hmget(RunKeys.of(waiter).run, ["status", "error", "attempt"])
    assert (status, error, attempt) == (b"running", b"", b"1")
    assert r.hget(RunKeys.of(waiter).run, "job").decode() in turn_queue(r).job_ids


def _waits(r: Redis, run_id: str, key: str = "acme") -> str:
    """The run's turn waits in line as wait_for_slot leaves it: its lease dropped, its turn deferred for
    the poll, and where to find it when a slot frees."""
    r.delete(RunKeys.of(run_id).lease)
    member, due = f"{run_id}:0:1", int(time.time() * 1000) + 30_000
    concurrency.stage_wake(r, key, run_id, member, due + 30_000)  # type: ignore[arg-type]
    r.zadd(TURNS_DEFERRED, {member: due})
    return member


def _woken(r: Redis, member: str) -> bool:
    return r.zscore(TURNS_DEFERRED, member) <= time.time() * 1000


def test_a_slot_freed_by_another_turns_acquire_still_wakes_the_first_waiter(r: Redis) -> None:
    """Save point B drops the lease and queues the run's next turn before the turn's own release runs:
    the next turn's acquire frees the old slot (its lease moved on) but, behind a waiter, does not take
    it. The release that follows found nothing to free and woke nobody: the slot sat idle a whole poll."""
    _hold(r, "a", "1:a")
    assert concurrency.acquire(r, "acme", "a", 1, "1:a").granted
    _hold(r, "w", "1:w")
    assert not concurrency.acquire(r, "acme", "w", 1, "1:w").granted
    waiter = _waits(r, "w")
    time.sleep(0.005)  # the line is ordered by when each began to wait, in ms: a began after w
    _hold(r, "a", "2:a")  # turn 2 of run a, on another worker, while turn 1 is ending
    assert not concurrency.acquire(r, "acme", "a", 1, "2:a").granted, "w is ahead"
    _waits(r, "a")
    assert concurrency.release(r, "acme", "a", "1:a") and _woken(r, waiter)


def test_a_slot_freed_while_a_turn_records_its_wait_wakes_it(r: Redis) -> None:
    """The holder ends between the waiter's acquire and its deferral: its release finds no deferred
    turn to wake. The waiter's own look once its wait is recorded wakes it."""
    _hold(r, "h", "1:h")
    assert concurrency.acquire(r, "acme", "h", 1, "1:h").granted
    _hold(r, "w", "1:w")
    assert not concurrency.acquire(r, "acme", "w", 1, "1:w").granted
    r.delete(RunKeys.of("h").lease)
    assert not concurrency.release(r, "acme", "h", "1:h"), "nothing to wake yet"
    waiter = _waits(r, "w")
    assert concurrency.wake_if_free(r, "acme", 1) and _woken(r, waiter)
    # While the key's slots are all held, that look wakes nobody.
    _hold(r, "w", "2:w")
    assert concurrency.acquire(r, "acme", "w", 1, "2:w").granted
    _hold(r, "x", "1:x")
    assert not concurrency.acquire(r, "acme", "x", 1, "1:x").granted
    assert not concurrency.wake_if_free(r, "acme", 1) and not _woken(r, _waits(r, "x"))


def test_an_operator_raising_a_keys_limit_wakes_the_turns_it_lets_in(r: Redis) -> None:
    """`agentpool limits set acme 3` while two turns wait behind one: both are woken now (their deferred
    turns made due), not when the holder ends or their poll comes; a limit that frees no slot wakes none."""
    concurrency.set_limit(r, "acme", 1)
    _hold(r, "h", "1:h")
    assert concurrency.acquire(r, "acme", "h", 5, "1:h").granted
    waiting = {}
    for run_id in ("w1", "w2", "w3"):
        _hold(r, run_id, "1:x")
        assert not concurrency.acquire(r, "acme", run_id, 5, "1:x").granted
        waiting[run_id] = _waits(r, run_id)
        time.sleep(0.002)  # the line is ordered by when each began to wait
    assert concurrency.set_limit(r, "acme", 1) == 0 and not any(_woken(r, m) for m in waiting.values())
    assert concurrency.set_limit(r, "acme", 3) == 2, "two slots free: the first two in line"
    assert [_woken(r, waiting[w]) for w in ("w1", "w2", "w3")] == [True, True, False]
    assert concurrency.set_limit(r, "acme", None) >= 1 and _woken(r, waiting["w3"]), "its run's own limit (5) holds"


def test_a_cancelled_waiter_leaves_the_line_and_the_next_one_is_woken(r: Redis) -> None:
    """Left in line, a cancelled run took the next wake-up and counted as ahead until its place expired."""
    holder = enqueue_run("pool_agents:support", "holds", connection=r, concurrency_key="acme", max_concurrency=1)
    gone = enqueue_run("pool_agents:support", "cancelled", connection=r, concurrency_key="acme", max_concurrency=1)
    waiting = enqueue_run("pool_agents:support", "waits", connection=r, concurrency_key="acme", max_concurrency=1)
    _hold(r, holder, "1:h")
    assert concurrency.acquire(r, "acme", holder, 1, "1:h").granted
    members = {}
    for run_id in (gone, waiting):
        _hold(r, run_id, "1:x")
        assert not concurrency.acquire(r, "acme", run_id, 1, "1:x").granted
        members[run_id] = _waits(r, run_id)
    cancel_run(gone, connection=r)
    assert r.zrange(ConcurrencyKeys.of("acme").waiting, 0, -1) == [waiting.encode()]
    r.delete(RunKeys.of(holder).lease)
    assert concurrency.release(r, "acme", holder, "1:h") and _woken(r, members[waiting])
    _hold(r, waiting, "2:x")
    assert concurrency.acquire(r, "acme", waiting, 1, "2:x").granted, "nobody left ahead of it"
