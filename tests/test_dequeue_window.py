"""A SIGTERM (a deploy) that reaches a forking worker between RQ's BLMOVE and the execution that claims
the job strands nothing: the turn goes back to the head of the queue and the next worker takes it at
once, not after the reaper's 30 s recheck. The fault point ``after_dequeue`` sends the worker a real
SIGTERM at exactly that instant."""

from __future__ import annotations

import signal
import time

import pytest
from test_delivered_twice import load_scripts, script

from agentpool import enqueue_run, wait_for_run
from agentpool.runtime.jobs import give_back, job_id, turn_queue
from agentpool.runtime.settings import connect
from agentpool.store.events import read as read_events
from agentpool.store.keys import RunKeys
from agentpool.testing.localpool import WorkerProcesses
from agentpool.testing.netfault import NetFault

from conftest import assert_valid_conversation, script_task

pytestmark = pytest.mark.crash


def test_a_sigterm_between_dequeue_and_start_gives_the_turn_back_to_the_head_of_the_queue(r, pool, model):
    model.set_scripts({"short": [{"text": "Done."}], "later": [{"text": "Later."}]})
    run_id = enqueue_run("pool_agents:support", script_task("short"), connection=r)
    behind = enqueue_run("pool_agents:support", script_task("later"), connection=r)
    job = r.hget(RunKeys.of(run_id).run, "job").decode()

    stopped = pool.start(1, AGENTPOOL_FAULTS="after_dequeue")[0]
    assert stopped.wait(timeout=60) == 0, "a warm stop:\n" + pool.logs()
    assert list((pool.tmp).glob(f"fault-after_dequeue-{run_id}-0")), "the SIGTERM came after the dequeue"

    queue = turn_queue(r)
    assert r.lrange(queue.intermediate_queue_key, 0, -1) == [], "nothing stranded in RQ's intermediate queue"
    assert queue.get_job_ids()[:1] == [job], "the turn is back at the head of the queue, ahead of the one behind"

    pool.start(1)
    for rid in (run_id, behind):
        run = wait_for_run(rid, timeout=60, connection=r)
        assert run.status == "completed", (run.error, pool.logs())
        assert_valid_conversation(run.messages)
    kinds = [e["kind"] for _i, e in read_events(r, run_id)]
    assert "takeover" not in kinds, "the next worker took the turn as queued; no reaper had to find it"


def test_a_job_left_in_the_intermediate_queue_by_a_killed_worker_is_given_back_without_a_takeover(r, pool, model):
    # SIGKILLed right after its BLMOVE: nobody claims the job. The reaper of the next worker gives it
    # back to the queue once it has sat there STRANDED_AFTER seconds, before the run's own recheck would
    # have called its job lost (a takeover, 30 s after the enqueue).
    model.set_scripts({"short": [{"text": "Done."}]})
    run_id = enqueue_run("pool_agents:support", script_task("short"), connection=r)
    killed = pool.start(1, AGENTPOOL_FAULTS="after_dequeue_killed", AGENTPOOL_REAPER_INTERVAL="0")[0]
    assert killed.wait(timeout=60) == -signal.SIGKILL, pool.logs()
    assert r.llen(turn_queue(r).intermediate_queue_key) == 1, "the job is stranded in the intermediate queue"

    pool.start(1)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    kinds = [e["kind"] for _i, e in read_events(r, run_id)]
    assert "takeover" not in kinds, "given back as it was; not found lost by the run's recheck"
    assert "given back to the queue" in pool.logs(20000)


def test_a_job_stranded_in_another_queues_intermediate_list_is_given_back_too(r, pool, model):
    # The same kill on a run of queue "urgent" (RQ's agentpool-urgent): its intermediate list is the
    # reaper's to watch as well, whichever queues the worker holding the reaper's lock serves. The next
    # worker serves "default" alone, so the one that takes the turn must be started after the give-back.
    model.set_scripts({"short": [{"text": "Done."}]})
    run_id = enqueue_run("pool_agents:support", script_task("short"), connection=r, queue="urgent")
    urgent = turn_queue(r, "urgent")
    killed = WorkerProcesses.start(
        pool, 1, "urgent", AGENTPOOL_FAULTS="after_dequeue_killed", AGENTPOOL_REAPER_INTERVAL="0"
    )[0]
    assert killed.wait(timeout=60) == -signal.SIGKILL, pool.logs()
    assert r.llen(urgent.intermediate_queue_key) == 1, "the job is stranded in the intermediate queue"

    pool.start(1)  # serves "default": its reaper gives the urgent job back
    deadline = time.monotonic() + 60
    while urgent.count == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert urgent.get_job_ids() == [job_id(run_id, 0)], ("given back to its own queue", pool.logs(20000))
    assert r.llen(urgent.intermediate_queue_key) == 0

    WorkerProcesses.start(pool, 1, "urgent", "--log-level", "INFO")
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    kinds = [e["kind"] for _i, e in read_events(r, run_id)]
    assert "takeover" not in kinds, "given back as it was; not found lost by the run's recheck"


def test_a_give_back_delivered_twice_pushes_the_job_once(r, redis_server):
    queue = turn_queue(r)
    r.rpush(queue.key, "r_other-t0000")
    r.rpush(queue.intermediate_queue_key, "r_given-t0000")
    load_scripts(r)
    with NetFault.to(redis_server.url) as proxy:
        lossy = connect(proxy.url)
        proxy.cut_next_reply(script("give_back_job"))
        give_back(lossy, turn_queue(lossy), "r_given-t0000")  # its reply lost, re-sent: finds it gone
        assert proxy.pending_cuts() == 0, "the reply was lost"
        lossy.close()
    assert r.lrange(queue.key, 0, -1) == [b"r_given-t0000", b"r_other-t0000"], "pushed once, at the head"
    assert r.llen(queue.intermediate_queue_key) == 0


def test_a_claimed_job_given_back_leaves_the_started_registry_and_is_pushed_once(r):
    """A worker claims a job in the round trip that fetches it (agentpool.worker.lean): a stop noticed
    after that gives it back out of the started registry, once however often the call is delivered."""
    queue = turn_queue(r)
    member = "r_claimed-t0000:93cbc626aaaa"
    r.zadd(queue.started_job_registry.key, {member: time.time() + 60})
    assert give_back(r, queue, "r_claimed-t0000", member)
    assert not give_back(r, queue, "r_claimed-t0000", member), "a second delivery finds it given back"
    assert r.lrange(queue.key, 0, -1) == [b"r_claimed-t0000"]
    assert r.zcard(queue.started_job_registry.key) == 0, "rq info no longer counts it executing"


@pytest.mark.parametrize("kind", ["forking", "threaded"])
def test_a_worker_killed_after_claiming_a_turn_before_its_lease_strands_nothing(kind, r, pool, model):
    """SIGKILLed between the claim (the job in RQ's started registry, out of the intermediate queue) and
    the lease: nobody holds the run, and no queue holds its job. A forking worker's machine is lost: the
    reaper finds the run's job started with no lease when the run's recheck comes due, and takes the turn
    over. A threaded worker's supervisor sees its child die and hands the turn over at once. Either way
    the run completes, the model is asked once (the killed attempt never got that far), and the dead
    claim is not left for `rq info` to count as executing."""
    model.set_scripts({"short": [{"text": "Done."}]})
    run_id = enqueue_run("pool_agents:support", script_task("short"), connection=r)
    job = r.hget(RunKeys.of(run_id).run, "job").decode()
    queue = turn_queue(r)
    if kind == "forking":
        killed = pool.start(1, AGENTPOOL_FAULTS="after_claim_killed", AGENTPOOL_REAPER_INTERVAL="0")[0]
        assert killed.wait(timeout=60) == -signal.SIGKILL, pool.logs()
        assert r.zscan(queue.started_job_registry.key, match=f"{job}:*")[1], "claimed: in the started registry"
        assert r.llen(queue.intermediate_queue_key) == 0 and queue.get_job_ids() == [], "and in no queue"
        assert not r.exists(RunKeys.of(run_id).lease), "nobody holds the run"
        pool.start(1)
        expected_kind = "lease_expiry"
    else:
        supervisor = WorkerProcesses.start(
            pool, 1, "--log-level", "INFO", "--concurrency", "2", AGENTPOOL_FAULTS="after_claim_killed"
        )[0]
        expected_kind = "horse_death"
    run = wait_for_run(run_id, timeout=90, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert list(pool.tmp.glob(f"fault-after_claim_killed-{run_id}-0")), "the kill came after the claim"
    takeovers = [e for _i, e in read_events(r, run_id) if e["kind"] == "takeover"]
    assert [e["cause_kind"] for e in takeovers] == [expected_kind], takeovers
    assert model.stats()["by_script"] == {"short": 1}, "the model was asked once"
    assert r.zcard(queue.started_job_registry.key) == 0, "the dead claim is not counted as executing"
    assert r.zcard(queue.failed_job_registry.key) == 0, "nor as failed: its run went on"
    if kind == "threaded":
        assert supervisor.poll() is None, "the supervisor outlived its child"
