"""A worker whose last dequeue left jobs waiting takes the next one and starts it in one round trip
(``LeanTurnJobs.take_waiting``, ``dequeue_claim.lua``) instead of RQ's BLMOVE and the claim after it. What
``rq info``, the reaper and the supervisor read stays as it was: a turn job goes from its queue straight
into the started registry under the worker's execution, any other job into RQ's intermediate queue for
RQ's own start."""

from __future__ import annotations

import pytest
from redis import Redis
from rq.job import Job
from test_delivered_twice import load_scripts, script

from agentpool import enqueue_run, wait_for_run
from agentpool.runtime.jobs import turn_queue
from agentpool.runtime.settings import connect
from agentpool.store.keys import RunKeys
from agentpool.testing.localpool import WorkerProcesses
from agentpool.testing.netfault import NetFault
from agentpool.worker.forking import AgentWorker
from agentpool.worker.lean import execution_tag

from conftest import assert_valid_conversation, script_task

READ = {"name": "read_notes", "input": {"topic": "release"}}
STEPS = [{"tool_calls": [READ]}, {"tool_calls": [READ]}, {"text": "All done."}]


def _worker(r: Redis, *queues: str) -> AgentWorker:
    return AgentWorker([turn_queue(r, name) for name in queues], connection=r, name="taker")


def test_a_waiting_turn_is_taken_and_started_at_once_in_the_workers_queue_order(r: Redis) -> None:
    later = enqueue_run("pool_agents:support", script_task("later"), connection=r, queue="default")
    first = enqueue_run("pool_agents:support", script_task("first"), connection=r, queue="urgent")
    worker = _worker(r, "urgent", "default")
    queues = worker._ordered_queues
    urgent, default = turn_queue(r, "urgent"), turn_queue(r, "default")

    queue, job = worker.take_waiting(queues)
    assert queue.name == urgent.name, "the worker's first queue first"
    assert job is not None and job.id == r.hget(RunKeys.of(first).run, "job").decode()
    member = worker.claimed_member(job)
    assert member.startswith(f"{job.id}:{execution_tag('taker')}"), "started under this worker's execution"
    assert r.zscore(urgent.started_job_registry.key, member) is not None, "rq info counts it as executing"
    assert r.llen(urgent.key) == 0 and r.llen(urgent.intermediate_queue_key) == 0, "in one place only"
    assert r.hget(worker.key, "state") == b"busy"

    queue, job = worker.take_waiting(queues)
    assert queue.name == default.name and job.id == r.hget(RunKeys.of(later).run, "job").decode()
    assert r.zcard(default.started_job_registry.key) == 1
    assert worker.take_waiting(queues) is None, "nothing waits: the worker blocks in BLMOVE instead"


def test_a_job_that_is_not_a_turn_goes_to_the_intermediate_queue_for_rqs_own_start(r: Redis) -> None:
    queue = turn_queue(r)
    other = queue.enqueue("builtins.len", "four")
    worker = _worker(r, "default")

    _queue, job = worker.take_waiting(worker._ordered_queues)
    assert job.id == other.id and worker.claimed_member(job) == "", "not started here"
    assert r.lrange(queue.intermediate_queue_key, 0, -1) == [other.id.encode()], "where BLMOVE puts it"
    assert r.zcard(queue.started_job_registry.key) == 0


def test_a_waiting_turn_whose_job_hash_is_gone_is_taken_off_and_not_started(r: Redis) -> None:
    queue = turn_queue(r)
    r.rpush(queue.key, "r_gone-t0003")
    worker = _worker(r, "default")

    _queue, job = worker.take_waiting(worker._ordered_queues)
    assert job is None, "skipped, as RQ skips a job whose hash is gone"
    assert r.llen(queue.key) == 0 and r.zcard(queue.started_job_registry.key) == 0
    assert r.llen(queue.intermediate_queue_key) == 0


@pytest.mark.parametrize("concurrency", ["1", "3"], ids=["forking", "threaded"])
def test_a_backlog_is_served_without_blocking_dequeues_and_leaves_nothing_behind(
    concurrency: str, r: Redis, pool, model
) -> None:
    model.set_scripts({"read": STEPS})
    run_ids = [enqueue_run("pool_agents:support", script_task("read"), connection=r) for _ in range(8)]
    r.config_resetstat()
    WorkerProcesses.start(
        pool, 1, "--concurrency", concurrency
    )  # fewer turns at a time than runs: the others' turns wait
    for run_id in run_ids:
        run = wait_for_run(run_id, timeout=90, connection=r)
        assert run.status == "completed", (run.error, pool.logs())
        assert_valid_conversation(run.messages)
    turns = 8 * len(STEPS)
    blocking = int(r.info("commandstats").get("cmdstat_blmove", {}).get("calls", 0))
    assert blocking < turns / 3, f"{blocking} BLMOVE for {turns} turns: the waiting turns were not taken at once"
    queue = turn_queue(r)
    assert r.llen(queue.intermediate_queue_key) == 0 and r.zcard(queue.started_job_registry.key) == 0
    assert Job.exists(r.hget(RunKeys.of(run_ids[0]).run, "job").decode(), connection=r) is False


def test_a_take_whose_reply_is_lost_finds_the_turn_it_took_instead_of_taking_another(r: Redis, redis_server) -> None:
    """Redis pops and starts a turn, the reply never reaches the worker: sent again as it was, the take
    would pop the next turn too and leave the first started under an execution nobody runs (found only
    by the run's 30 s recheck, as a takeover). The worker asks again for what it took."""
    first = enqueue_run("pool_agents:support", script_task("first"), connection=r)
    behind = enqueue_run("pool_agents:support", script_task("behind"), connection=r)
    queue = turn_queue(r)
    load_scripts(r)
    with NetFault.to(redis_server.url) as proxy:
        lossy = connect(proxy.url)
        worker = _worker(lossy, "default")
        proxy.cut_next_reply(script("dequeue_claim"))
        _queue, job = worker.take_waiting(worker._ordered_queues)
        assert proxy.pending_cuts() == 0, "the reply was lost"
        lossy.close()
    assert job.id == r.hget(RunKeys.of(first).run, "job").decode(), "the turn Redis popped, not the next"
    assert r.zrange(queue.started_job_registry.key, 0, -1) == [worker.claimed_member(job).encode()], "started once"
    assert queue.get_job_ids() == [r.hget(RunKeys.of(behind).run, "job").decode()], "the next turn still waits"
