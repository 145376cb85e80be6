"""Failovers behind an endpoint that follows them (a managed primary endpoint, a virtual IP, a proxy in
front of Sentinel): a client's re-sent request reaches the promoted replica, which lacks what the old
primary had not yet replicated. Real redis-server processes (``FollowingEndpoint``), real workers, the
scripted model; the test promotes the replica itself, at the instant it chooses."""

from __future__ import annotations

import hashlib
import time

import pytest
from redis import Redis

from agentpool import enqueue_run, wait_for_run
from agentpool.store.errors import RedisUnreachable
from agentpool.store.keys import DURABILITY_PROBE, RunKeys
from agentpool.store.scripts import source
from agentpool.testing.localpool import redis_answers
from agentpool.testing.netfault import resp_command
from agentpool.testing.replicated import FollowingEndpoint, logs_of

from conftest import Pool, assert_valid_conversation, script_task

pytestmark = pytest.mark.failover

EMAIL = {"name": "send_email", "input": {"to": "a@example.com", "subject": "s", "body": "b"}}


@pytest.fixture
def chain(tmp_path):
    servers = FollowingEndpoint(tmp_path / "redis").start()
    yield servers
    servers.stop()


@pytest.fixture
def chain_pool(chain, model, tmp_path):
    pool = Pool(chain.url, model, tmp_path)
    yield pool
    pool.stop()


def _on_the_replica(chain: FollowingEndpoint, key: str, timeout: float = 30) -> None:
    replica = Redis(port=chain.replica.port)
    deadline = time.monotonic() + timeout
    try:
        while not replica.exists(key):
            assert time.monotonic() < deadline, f"{key} never reached the replica"
            time.sleep(0.01)
    finally:
        replica.close()


def _wait_after_failover(chain: FollowingEndpoint, pool: Pool, run_id: str, r: Redis):
    """The run's end, read through the endpoint with agentpool's client (it rides out a dropped
    connection, as an app's should). If the endpoint stays unreachable, the error says what each server
    behind it was doing: the promoted replica's log, whether it answers when asked directly."""
    try:
        return wait_for_run(run_id, timeout=90, connection=r)
    except RedisUnreachable as exc:
        answers = redis_answers(chain.replica.url)
        raise AssertionError(
            f"{exc}\nthe promoted replica answers directly: {answers}\n"
            + logs_of([chain.replica, chain.sub_replica])
            + "\n"
            + pool.logs()
        ) from exc


def _sha(script: str) -> str:
    return hashlib.sha1(source(script).encode()).hexdigest()


def test_a_guard_resent_to_the_promoted_replica_does_not_let_an_unsafe_tool_run_twice(chain, chain_pool, model):
    """The lease, save point A and the intent reach the old primary only (the replica's link is cut);
    the primary dies with the guard in flight and the endpoint re-points at the promoted replica,
    whose own replica acknowledges at once. The guard must not pass there: the email is sent once."""
    model.set_scripts({"mail": [{"tool_calls": [EMAIL]}, {"text": "Sent."}]})
    r = chain_pool.client()
    run_id = enqueue_run("pool_agents:support", script_task("mail"), connection=r)
    _on_the_replica(chain, RunKeys.of(run_id).run)
    chain.replica_link.partition()
    chain.endpoint.hold_next(DURABILITY_PROBE.encode())
    chain_pool.start(1, AGENTPOOL_REPLICA_ACKS="1")
    assert chain.endpoint.wait_held(60), "the guard never ran: " + chain_pool.logs()
    chain.promote()
    chain.endpoint.release()

    run = _wait_after_failover(chain, chain_pool, run_id, r)
    assert run.status == "completed", (run.status, run.error, chain_pool.logs())
    assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    emails = [e for e in chain_pool.effects() if e["tool"] == "send_email"]
    assert len(emails) == 1, f"an unsafe tool ran {len(emails)} times: {emails}\n{chain_pool.logs()}"


def test_a_tool_result_never_lands_on_a_primary_that_lost_save_point_a(chain, chain_pool, model):
    """The lease reached the replica, then its link was cut: save point A stayed on the old primary,
    which dies while the turn's read tool runs. The promoted replica holds the lease but not A: the
    outcome and save point B must not land there (a tool_result for a tool_use its conversation does
    not have, and the next call a 400); the turn is redone from what the new primary has."""
    read = {"name": "slow_read", "input": {"seconds": 2}}
    model.set_scripts({"read": [{"tool_calls": [read]}, {"text": "Read it."}]})
    r = chain_pool.client()
    run_id = enqueue_run("pool_agents:support", script_task("read"), connection=r)
    chain.endpoint.hold_next(resp_command("EVALSHA", _sha("commit_response")))
    chain_pool.start(1)
    assert chain.endpoint.wait_held(60), "save point A never came: " + chain_pool.logs()
    _on_the_replica(chain, RunKeys.of(run_id).lease)
    chain.replica_link.partition()
    chain.endpoint.release()
    chain_pool.wait_for_effect("slow_read")
    chain.promote()

    run = _wait_after_failover(chain, chain_pool, run_id, r)
    assert run.status == "completed", (run.status, run.error, chain_pool.logs())
    assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    assert "is not where this turn left it" in chain_pool.logs(tail=1_000_000)
