"""Bad records, newer schemas, Redis restarts, dropped connections, warm shutdown."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections import Counter

import pytest
from redis import Redis
from rq.job import Job

import agentpool
from agentpool import cancel_run, enqueue_run, get_run, wait_for_run
from agentpool.runtime.jobs import job_id, turn_queue
from agentpool.runtime.settings import connect
from agentpool.store import checkpoint, handback
from agentpool.store.keys import RunKeys
from agentpool.store.records import SCHEMA_VERSION
from agentpool.testing.localpool import RedisServer, WorkerProcesses, horses_of

from conftest import Pool, assert_valid_conversation, script_task, wait_for_status

SIMPLE = [{"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]}, {"text": "ok"}]


def _snapshot(r: Redis, run_id: str) -> dict:
    keys = RunKeys.of(run_id)
    return {k: r.dump(k) for k in (keys.run, keys.messages, keys.ledger)}


def test_a_corrupt_record_fails_its_run_clearly_and_the_worker_serves_others(r, pool, model):
    model.set_scripts({"simple": SIMPLE})
    bad = enqueue_run("pool_agents:support", script_task("simple"), connection=r)
    r.lset(RunKeys.of(bad).messages, 0, b"\xc1 not msgpack")
    good = enqueue_run("pool_agents:support", script_task("simple"), connection=r)
    pool.start(1)

    assert wait_for_run(good, timeout=60, connection=r).status == "completed"
    wait_for_status(r, bad, "failed")
    header = checkpoint.load_run(r, bad, with_messages=False)
    assert "message 0 is not valid msgpack" in header.error
    assert r.lindex(RunKeys.of(bad).messages, 0) == b"\xc1 not msgpack", "the data is left as found"
    with pytest.raises(Exception, match="not valid msgpack"):
        get_run(bad, connection=r)


@pytest.mark.parametrize("concurrency", ["1", "3"], ids=["forking", "threaded"])
@pytest.mark.parametrize(
    ("field", "garbage"),
    [("data", b"\xc1 not a job"), ("created_at", b"not a date")],
    ids=["payload", "header"],
)
def test_a_turn_job_that_does_not_decode_costs_its_turn_a_reenqueue_and_nothing_else(
    r, pool, model, concurrency, field, garbage
):
    """A turn's RQ job hash that no worker can read: a payload that does not decode fails the job (RQ's
    failure handling), a hash RQ cannot even restore is dropped by the worker that dequeued it (out of
    every queue: no worker dies on it again). Either way the worker goes on serving, and the reaper
    re-enqueues the turn under a new job: the run's checkpoint is the truth."""
    model.set_scripts({"simple": SIMPLE})
    bad = enqueue_run("pool_agents:support", script_task("simple"), connection=r)
    r.hset(Job.key_for(job_id(bad, 0)), field, garbage)
    good = enqueue_run("pool_agents:support", script_task("simple"), connection=r)
    WorkerProcesses.start(pool, 1, "--log-level", "INFO", "--concurrency", concurrency)

    assert wait_for_run(good, timeout=60, connection=r).status == "completed"
    queue = turn_queue(r)
    deadline = time.monotonic() + 30
    while any(r.lpos(key, job_id(bad, 0)) is not None for key in (queue.key, queue.intermediate_queue_key)):
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.05)
    r.zadd("ap:runs:watch", {bad: 0})  # as when its queued deadline has passed: the reaper looks now
    run = wait_for_run(bad, timeout=60, connection=r)
    assert run.status == "completed", (run.status, run.error, pool.logs())
    assert len(pool.alive()) == 1, "the worker that met the job goes on"
    if field == "created_at":
        assert "does not decode" in pool.logs(100_000)


def test_a_run_from_a_newer_schema_is_left_untouched(r, pool, model):
    model.set_scripts({"simple": SIMPLE})
    newer = enqueue_run("pool_agents:support", script_task("simple"), connection=r)
    r.hset(RunKeys.of(newer).run, "v", SCHEMA_VERSION + 1)
    before = _snapshot(r, newer)
    good = enqueue_run("pool_agents:support", script_task("simple"), connection=r)
    pool.start(1)

    assert wait_for_run(good, timeout=60, connection=r).status == "completed"
    deadline = time.monotonic() + 60  # the job's end is waited for (a turn's job is deleted as it ends)
    while r.exists(Job.key_for(job_id(newer, 0))):
        assert time.monotonic() < deadline, "the newer run's job never ended"
        time.sleep(0.05)
    assert turn_queue(r).failed_job_registry.count == 0, "handed back for a newer worker: not a failed job"
    record = handback.read(r, RunKeys.of(newer))
    assert record.reason == "too_new" and "newer than this worker" in record.detail
    time.sleep(1)  # let the reaper look at it too
    assert _snapshot(r, newer) == before


@pytest.mark.crash
def test_runs_survive_a_redis_restart(tmp_path, model):
    server = RedisServer(tmp_path, durable=True).start()
    r = Redis.from_url(server.url)
    pool = Pool(server.url, model, tmp_path)
    try:
        model.set_scripts(
            {
                "steps": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 0.3}}]} for _ in range(6)]
                + [{"text": "done"}]
            }
        )
        pool.start(2)
        runs = [enqueue_run("pool_agents:support", script_task("steps"), connection=r) for _ in range(4)]
        time.sleep(1.5)
        server.stop()  # SIGTERM: Redis fsyncs its AOF and exits
        time.sleep(1.0)
        server.start()  # same port, same AOF
        for run_id in runs:
            run = wait_for_run(run_id, timeout=90, connection=r)
            assert run.status == "completed", (run.error, pool.logs())
            assert run.turns == 7
            assert_valid_conversation(run.messages)
    finally:
        pool.stop()
        server.stop()


def test_an_apps_wait_rides_out_a_redis_restart_with_agentpool_connect(tmp_path, model):
    """The client ``agentpool.connect`` makes (the README's) keeps an app's ``wait_for_run`` going
    through six seconds without Redis, longer than redis-py's own default retries last."""
    server = RedisServer(tmp_path, durable=True).start()
    r = agentpool.connect(server.url)
    pool = Pool(server.url, model, tmp_path)
    waited = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        model.set_scripts(
            {"steps": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 1}}]}] * 3 + [{"text": "done"}]}
        )
        pool.start(1)
        run_id = enqueue_run("pool_agents:support", script_task("steps"), connection=r)
        wait_for_status(r, run_id, "running")
        run = waited.submit(wait_for_run, run_id, timeout=120, connection=r)
        server.stop()  # SIGTERM: Redis fsyncs its AOF and exits
        time.sleep(6.0)
        assert not run.done(), run.exception()  # it waited through the outage, polling
        server.start()  # same port, same AOF
        done = run.result(timeout=150)
        assert (done.status, done.turns, done.result) == ("completed", 4, "done"), (done.error, pool.logs())
        assert_valid_conversation(done.messages)
    finally:
        waited.shutdown(wait=False, cancel_futures=True)
        pool.stop()
        r.close()
        server.stop()


def test_dropped_connections_mid_turn_are_retried_not_failed(r, pool, model):
    model.set_scripts(
        {
            "steps": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 0.2}}]} for _ in range(5)]
            + [{"text": "done"}]
        }
    )
    pool.start(2)
    runs = [enqueue_run("pool_agents:support", script_task("steps"), connection=r) for _ in range(4)]
    stop = threading.Event()
    kills = []

    def killer() -> None:
        admin = Redis.from_url(pool.env["REDIS_URL"])
        while not stop.wait(0.4):
            kills.append(admin.client_kill_filter(_type="normal", skipme=True))

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    client = connect(pool.env["REDIS_URL"])  # the app's own client must retry too; agentpool's does
    try:
        finished = [wait_for_run(run_id, timeout=90, connection=client) for run_id in runs]
    finally:
        stop.set()
        thread.join()
    assert sum(kills) > 0, "connections were dropped while runs were in flight"
    for run in finished:
        assert run.status == "completed", (run.error, pool.logs())


def test_sigterm_lets_the_turn_in_flight_finish(r, pool, model):
    model.set_scripts(
        {
            "slow": [
                {"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]},
                {"text": "done"},
            ]
        }
    )
    worker = pool.start(1)[0]
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    worker.send_signal(signal.SIGTERM)  # warm shutdown, as RQ does
    assert worker.wait(timeout=30) == 0
    state = checkpoint.load_run(r, run_id, with_messages=False)
    assert state.turns == 1 and state.phase == "model", "the turn committed its tool results before exiting"
    pool.start(1)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed"
    assert Counter(e["tool"] for e in pool.effects())["slow_read"] == 1, "the turn was not cut and re-run"


# -- a damaged header field on every takeover path: the run fails with the reason, the worker goes on --

SLOW_THEN_DONE = [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 1.5}}]}, {"text": "done"}]
DAMAGE = {"attempt": b"x", "job": b"\xff\xfe not utf-8", "status": b"\xffrunning"}


def _damage_mid_turn(r: Redis, pool: Pool, field: str) -> str:
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    r.hset(RunKeys.of(run_id).run, field, DAMAGE[field])
    return run_id


def _assert_failed_with_reason_and_pool_goes_on(r: Redis, pool: Pool, run_id: str, field: str) -> None:
    wait_for_status(r, run_id, "failed", timeout=60)
    error = r.hget(RunKeys.of(run_id).run, "error").decode()
    assert repr(field) in error and "cannot be taken over" in error, error
    assert r.ttl(RunKeys.of(run_id).run) > 0, "a failed run expires after the retention, as every finished run"
    after = enqueue_run("pool_agents:support", script_task("simple"), connection=r)
    assert wait_for_run(after, timeout=60, connection=r).status == "completed", pool.logs()
    assert pool.logs().count("could not check run") == 0, "the reaper does not log the same run every second"


@pytest.mark.crash
@pytest.mark.parametrize("field", sorted(DAMAGE))
def test_a_damaged_header_found_by_the_horse_death_handler_fails_the_run_not_the_worker(field, r, pool, model):
    model.set_scripts({"slow": SLOW_THEN_DONE, "simple": SIMPLE})
    worker = pool.start(1)[0]
    run_id = _damage_mid_turn(r, pool, field)
    for horse in horses_of(worker.pid):
        os.kill(horse, signal.SIGKILL)  # the OOM killer's usual victim: the parent's handler takes over
    _assert_failed_with_reason_and_pool_goes_on(r, pool, run_id, field)
    assert worker.poll() is None, "the worker survived its handler"


@pytest.mark.crash
def test_a_damaged_header_found_by_the_supervisor_fails_the_run_not_the_supervisor(r, pool, model):
    model.set_scripts({"slow": SLOW_THEN_DONE, "simple": SIMPLE})
    supervisor = WorkerProcesses.start(pool, 1, "--log-level", "INFO", "--concurrency", "2")[0]
    run_id = _damage_mid_turn(r, pool, "attempt")
    (child,) = horses_of(supervisor.pid)  # the threaded worker leads its own process group
    os.kill(child, signal.SIGKILL)
    _assert_failed_with_reason_and_pool_goes_on(r, pool, run_id, "attempt")
    assert supervisor.poll() is None


@pytest.mark.crash
def test_a_damaged_header_found_by_the_reaper_fails_the_run_once(r, pool, model):
    model.set_scripts({"slow": SLOW_THEN_DONE, "simple": SIMPLE})
    first = pool.start(1)[0]
    run_id = _damage_mid_turn(r, pool, "attempt")
    pool.kill(first)  # worker and horse: the lease expires, and the reaper of another worker finds it
    pool.start(1)
    _assert_failed_with_reason_and_pool_goes_on(r, pool, run_id, "attempt")


def test_an_old_reaper_leaves_a_newer_run_with_a_status_it_does_not_know_alone(r):
    """Not damage: a newer agentpool may have a status this one does not know. It is not failed."""
    from agentpool.runtime.reaper import reap_once
    from agentpool.store.keys import RUNS_WATCH

    run_id = enqueue_run("pool_agents:support", "a task", connection=r)
    keys = RunKeys.of(run_id)
    r.hset(keys.run, mapping={"v": SCHEMA_VERSION + 1, "status": "paused_by_a_newer_agentpool"})
    r.zadd(RUNS_WATCH, {run_id: 0})
    before = _snapshot(r, run_id)
    assert reap_once(r) == []
    assert _snapshot(r, run_id) == before and r.zscore(RUNS_WATCH, run_id) > 0


def test_a_turn_that_keeps_dying_fails_its_run_which_then_expires_like_any_finished_run(r, monkeypatch):
    from agentpool.runtime.takeover import MAX_TURN_ATTEMPTS, requeue_turn

    monkeypatch.setenv("AGENTPOOL_RETENTION_SECONDS", "600")
    run_id = enqueue_run("pool_agents:support", "a task whose turn kills every worker", connection=r)
    keys = RunKeys.of(run_id)
    r.hset(keys.run, mapping={"status": "running", "attempt": MAX_TURN_ATTEMPTS})
    assert requeue_turn(r, run_id, cause="its horse died", cause_kind="horse_death") is None
    header = r.hgetall(keys.run)
    assert header[b"status"] == b"failed" and b"times without finishing" in header[b"error"], header
    assert all(0 < r.ttl(key) <= 600 for key in (keys.run, keys.messages, keys.events)), [
        r.ttl(k) for k in (keys.run, keys.messages, keys.events)
    ]


def test_a_stale_job_handed_back_on_an_ended_run_leaves_no_record_behind(r, redis_server, monkeypatch):
    """A job for a run that has ended, taken by an older worker after an upgrade: the record is too
    new for it, so it hands the turn back; a hand-back record written then would outlive the run."""
    from agentpool.runtime.turn import run_turn

    monkeypatch.setenv("REDIS_URL", redis_server.url)  # the turn outside a worker connects as a worker does
    run_id = enqueue_run("pool_agents:support", "ended before its job ran", connection=r)
    keys = RunKeys.of(run_id)
    cancel_run(run_id, connection=r)
    r.hset(keys.run, "v", SCHEMA_VERSION + 1)  # written by a newer agentpool
    run_turn(run_id, 0)
    assert not r.exists(keys.handback), r.hgetall(keys.handback)
    assert r.ttl(keys.run) > 0


@pytest.mark.parametrize("kind", ["forking", "threaded"])
def test_a_warm_stop_does_not_wait_a_minute_for_the_command_channel(r, kind):
    """RQ 3 with redis-py 8: a worker's command-channel thread that saw its unsubscribe land waits up to
    60 s for a subscription, and RQ's unsubscribe then joins it: warm shutdowns hung for a minute under
    load. The worker's own unsubscribe ends the channel whatever state its thread is in."""
    import threading

    from agentpool.worker.forking import AgentWorker
    from agentpool.worker.threaded import ThreadedWorker

    worker = (AgentWorker if kind == "forking" else ThreadedWorker)(connection=r, name=f"channel-{kind}")
    worker.subscribe()
    deadline = time.monotonic() + 60
    while not worker.pubsub.subscribed:  # the subscription landed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.pubsub.unsubscribe()  # what RQ's unsubscribe sends first: the thread sees it land...
    while worker.pubsub.subscribed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # ...and goes on to wait for a subscription (RQ's sleep_time: 60 s)
    stopping = threading.Thread(target=worker.unsubscribe, daemon=True)
    stopping.start()
    stopping.join(timeout=20)
    assert not stopping.is_alive(), "the worker's stop waited for its command channel's minute"


def test_a_turn_past_the_workers_turn_timeout_stops_its_run_once_instead_of_retrying_it(r, pool, model):
    """AGENTPOOL_TURN_TIMEOUT is the forking worker's hard limit on a runaway turn, and the worker's own
    setting holds (this test process, which enqueues, has the default hour). The turn is cut once and its
    run stops, resumable, with the reason: retried as a crash it would run as long again, 25 times."""
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 30}}]}, {"text": "ok"}]})
    pool.start(1, AGENTPOOL_TURN_TIMEOUT="3")
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    wait_for_status(r, run_id, "stopped", timeout=60)
    run = get_run(run_id, connection=r)
    assert "ran past AGENTPOOL_TURN_TIMEOUT (3 s)" in run.error and "resume" in run.error, run.error
    time.sleep(2)  # a reaper pass or two: nothing takes the turn up again
    assert [e["tool"] for e in pool.effects()] == ["slow_read"], "the cut turn was not retried"
    assert r.zcard(turn_queue(r).failed_job_registry.key) == 0, "a stop, not a failed job"
