"""The reaper's watch set changes only if the run is still in the state the change was decided from.

Each race is played in a chosen order, not hoped for: the reaper runs its real scan (``reap_once``)
through ``agentpool.testing.netfault``, which holds its write to the watch set in flight; a person's
action (resume, approve, cancel) lands meanwhile; then the reaper's write is let through.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from redis import Redis

from agentpool import approve, cancel_run, resume
from agentpool.runtime.reaper import reap_once
from agentpool.runtime.settings import connect
from agentpool.store import approvals, checkpoint
from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.store.lease import Acquire, acquire
from agentpool.store.scripts import run_script
from agentpool.testing.netfault import NetFault, resp_command

RUN = "r_race0001"
KEYS = RunKeys.of(RUN)
WATCH_WRITE = resp_command("EVALSHA", run_script._script("watch_update").sha)


@pytest.fixture
def proxy(r: Redis, redis_server) -> Iterator[NetFault]:
    with NetFault.to(redis_server.url) as fault:
        yield fault


def _running(r: Redis) -> str:
    with r.pipeline(transaction=True) as pipe:
        pipe.multi()
        checkpoint.stage_create(pipe, RUN, agent="pool_agents:guarded", task="ship it", limits={}, now=time.time())
        pipe.execute()
    got = acquire(r, KEYS, turn=0, worker_id="w1.100", ttl_ms=10_000)
    assert got.code is Acquire.ACQUIRED
    return got.token


def _race(proxy: NetFault, person_acts) -> None:
    """The reaper scans with its write to the watch set held; ``person_acts`` lands first."""
    reaper = connect(proxy.url)
    proxy.hold_next(WATCH_WRITE)
    scan = threading.Thread(target=reap_once, args=(reaper,))
    scan.start()
    try:
        assert proxy.wait_held(), "the reaper never decided to change the watch set"
        person_acts()
    finally:
        proxy.release()
        scan.join(timeout=30)
        reaper.close()
    assert not scan.is_alive()


def _due_now(r: Redis) -> None:
    r.zadd(RUNS_WATCH, {RUN: 0})


def test_a_resume_racing_the_reapers_removal_of_a_stopped_run_keeps_it_watched(r, proxy):
    token = _running(r)
    checkpoint.finish(r, KEYS, token, status="stopped", error="max_turns reached")
    _due_now(r)  # the reaper looks at it and reads "stopped": remove it
    _race(proxy, lambda: resume(RUN, add_turns=1, connection=r))
    assert r.hget(KEYS.run, "status") == b"running"
    assert r.zscore(RUNS_WATCH, RUN) is not None, "a running run the reaper no longer watches would never be repaired"


def test_an_approval_racing_the_reapers_expiry_check_keeps_the_run_watched(r, proxy):
    token = _running(r)
    call = {"id": "toolu_d", "name": "deploy", "input": {"version": "2.4.1"}}
    checkpoint.commit_response(
        r,
        KEYS,
        token,
        turns_before=0,
        message={"role": "assistant", "content": [{"type": "tool_use", **call}]},
        pending=[call],
    )
    approvals.request(r, KEYS, token, call, now=time.time(), deadline=None)
    checkpoint.finish(r, KEYS, token, status="waiting_approval")
    _due_now(r)  # the reaper reads the approvals: one open call, no deadline: stop watching
    _race(proxy, lambda: approve(RUN, connection=r))
    assert r.hget(KEYS.run, "status") == b"running"
    assert r.zscore(RUNS_WATCH, RUN) is not None, "the approved run's turn must stay watched"


def test_a_cancel_racing_the_reapers_reschedule_does_not_bring_the_run_back(r, proxy):
    _running(r)  # lease held: the reaper reschedules the run for when the lease would expire
    _due_now(r)
    _race(proxy, lambda: cancel_run(RUN, connection=r))
    assert r.hget(KEYS.run, "status") == b"cancelled"
    assert r.zscore(RUNS_WATCH, RUN) is None, "a cancelled run is not watched again"
