"""A worker claims a turn job (it enters RQ's started registry) and takes the run's lease a round trip
later. The reaper looking at the run in between must not take the turn over: that would count an
attempt and drop the live execution from the started registry, so the worker's death mid-turn would be
seen only when its lease expired. A claim whose lease never comes (its worker died in between) is taken
over once the grace has passed; a lease that lapsed is taken over at once, as before.

The claim is the real worker's (``AgentWorker.dequeue_claimed``, no process forked) and the reaper's
scan is the real one (``reap_once``), run here in the order chosen."""

from __future__ import annotations

import time

from redis import Redis

from agentpool import enqueue_run
from agentpool.runtime.jobs import turn_queue
from agentpool.runtime.reaper import reap_once
from agentpool.store.events import read as read_events
from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.store.lease import Acquire, acquire
from agentpool.worker.forking import AgentWorker

from conftest import script_task


def _claimed_run(r: Redis) -> tuple[str, str]:
    """A run whose first turn's job a worker has just claimed, and whose recheck is due now."""
    run_id = enqueue_run("pool_agents:support", script_task("short"), connection=r)
    job, _queue = AgentWorker(connection=r).dequeue_claimed(None)
    assert job.id == r.hget(RunKeys.of(run_id).run, "job").decode()
    r.zadd(RUNS_WATCH, {run_id: 0})
    return run_id, job.id


def _claimed(r: Redis, job_id: str) -> bool:
    return bool(r.zscan(turn_queue(r).started_job_registry.key, match=f"{job_id}:*")[1])


def _takeovers(r: Redis, run_id: str) -> list[dict]:
    return [e for _i, e in read_events(r, run_id) if e["kind"] == "takeover"]


def test_the_reaper_leaves_a_just_claimed_turn_to_its_worker_and_takes_it_over_once_its_lease_lapses(r):
    run_id, job_id = _claimed_run(r)
    keys = RunKeys.of(run_id)

    assert reap_once(r) == [], "claimed a moment ago: its worker is about to take the lease"
    assert _takeovers(r, run_id) == [] and r.hget(keys.run, "attempt") in (None, b"0")
    assert _claimed(r, job_id), "the live execution is still in the started registry"
    assert r.hget(keys.run, "job").decode() == job_id

    got = acquire(r, keys, turn=0, worker_id="w1.100", ttl_ms=10_000, job_id=job_id)  # its worker goes on
    assert got.code is Acquire.ACQUIRED
    r.delete(keys.lease)  # and dies: its lease lapses
    r.zadd(RUNS_WATCH, {run_id: 0})
    assert reap_once(r) == [run_id], "a lapsed lease is taken over at once, with no grace"
    assert [e["cause_kind"] for e in _takeovers(r, run_id)] == ["lease_expiry"]


def test_a_claim_whose_lease_never_comes_is_taken_over_after_the_grace(r):
    run_id, job_id = _claimed_run(r)
    assert reap_once(r, claim_grace=0.3) == []
    time.sleep(0.4)
    r.zadd(RUNS_WATCH, {run_id: 0})
    assert reap_once(r, claim_grace=0.3) == [run_id]
    (takeover,) = _takeovers(r, run_id)
    assert takeover["cause_kind"] == "lease_expiry" and "lease not taken" in takeover["cause"], takeover
    assert not _claimed(r, job_id), "the dead claim left the started registry"
    assert r.hget(RunKeys.of(run_id).run, "job").decode() != job_id, "the turn went on under a new job"
