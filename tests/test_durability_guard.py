"""The durability guard (``agentpool.store.durability``) against real redis-server processes: its probe
is acknowledged only where the writes it guards are, a connection lost during it is "not replicated",
and forked work horses inherit the worker's decision of which guard applies instead of each paying it."""

from __future__ import annotations

import signal
import time

import pytest
from redis import Redis

from agentpool import enqueue_run, wait_for_run
from agentpool.runtime import durability
from agentpool.runtime.settings import connect
from agentpool.store import checkpoint, ledger
from agentpool.store.codec import pack
from agentpool.store.durability import Guard, NotReplicated, Proof, wait_durable
from agentpool.store.keys import DURABILITY_PROBE, RunKeys
from agentpool.store.lease import acquire
from agentpool.testing.localpool import RedisServer
from agentpool.testing.netfault import NetFault

from conftest import Pool, script_task

CALL = {"id": "toolu_1", "name": "send_email", "input": {"to": "a@example.com"}}
GUARD = Guard(replicas=1, timeout_ms=2000)


@pytest.fixture
def replicated(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "q").mkdir()
    primary = RedisServer(tmp_path / "p").start()
    replica = RedisServer(tmp_path / "q", extra_args=("--replicaof", "127.0.0.1", str(primary.port))).start()
    r = Redis(port=replica.port)
    deadline = time.monotonic() + 30
    while r.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)
    primary.replica_port = replica.port
    yield primary
    r.close()
    replica.stop()
    primary.stop()


def _a_guarded_call(r: Redis) -> Proof:
    """A run whose turn took the lease, committed save point A asking for CALL and wrote its intent."""
    run_id = enqueue_run("pool_agents:support", "task", connection=r)
    keys = RunKeys.of(run_id)
    token = acquire(r, keys, turn=0, worker_id="w.1", ttl_ms=30_000).token
    message = {"role": "assistant", "content": [{"type": "tool_use", **CALL}]}
    checkpoint.commit_response(r, keys, token, turns_before=0, message=message, pending=[CALL])
    intent = ledger.write_intent(r, keys, token, CALL, effect="unsafe", attempt=1, now=1.0, at=(1, "tools"))
    return Proof(keys, token, 1, "tools", CALL["id"], pack(intent))


def test_the_probe_is_acknowledged_only_where_the_guarded_writes_are(replicated):
    r = connect(replicated.url)
    proof = _a_guarded_call(r)
    wait_durable(r, GUARD, proof)
    probes = int(r.get(DURABILITY_PROBE))
    refused = {
        "the lease is not this turn's": Proof(proof.keys, "1:someone.else", 1, "tools", proof.field, proof.intent),
        "not at the turn's save point A": Proof(proof.keys, proof.token, 0, "model", proof.field, proof.intent),
        "the call's intent is not there": Proof(proof.keys, proof.token, 1, "tools", proof.field, pack({"x": 1})),
    }
    for said, wrong in refused.items():
        with pytest.raises(NotReplicated, match=said):
            wait_durable(r, GUARD, wrong)
    assert int(r.get(DURABILITY_PROBE)) == probes, "a refused probe writes nothing a replica could acknowledge"


def test_a_connection_lost_during_the_guard_is_not_replicated_never_retried(replicated):
    """The guard's reply is lost after Redis applied it: a re-send could reach another server (an endpoint
    that follows a failover), so the guard refuses the call instead of retrying."""
    r = connect(replicated.url)
    proof = _a_guarded_call(r)
    with NetFault.to(replicated.url) as proxy:
        lossy = connect(proxy.url)
        proxy.cut_next_reply(DURABILITY_PROBE.encode())
        with pytest.raises(NotReplicated, match="connection was lost during the guard"):
            wait_durable(lossy, GUARD, proof)
        assert proxy.replies_cut == 1
        wait_durable(lossy, GUARD, proof)  # the same client goes on: the next guard passes
        lossy.close()


def test_a_primary_restarted_without_the_writes_acknowledges_no_guard_of_them(replicated):
    """A primary restarted inside a client's retry window (its writes lost: no persistence here, an
    fsync that had not happened for WAITAOF): its replica resyncs from it and acknowledges anything it
    writes from then on. A plain probe passes there; the guard's probe does not, for the intent is gone."""
    r = connect(replicated.url)
    proof = _a_guarded_call(r)
    replicated.stop(signal.SIGKILL)
    replicated.start()
    replica = Redis(port=replicated.replica_port)
    deadline = time.monotonic() + 30
    while replica.info("replication").get("master_link_status") != "up" or replica.exists(proof.keys.run):
        assert time.monotonic() < deadline, "the replica never resynced from the restarted primary"
        time.sleep(0.05)
    replica.close()
    wait_durable(r, GUARD)  # a replica acknowledges the restarted primary's writes
    with pytest.raises(NotReplicated, match="the lease is not this turn's there"):
        wait_durable(r, GUARD, proof)


def test_forked_work_horses_inherit_the_decision_instead_of_each_probing(tmp_path, model):
    """With INFO refused (an ACL user without @dangerous) a lone Redis is told from one with replicas
    by a probe write a replica would acknowledge within 200 ms. The forking worker decides before it
    forks, at most once per RECHECK, and its horses inherit that: not one probe per guarded turn."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    admin = Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "limited", "reset", "on", ">pw", "~*", "&*", "+@all", "-@dangerous")
    pool = Pool(server.url.replace("redis://", "redis://limited:pw@"), model, tmp_path)
    email = {"name": "send_email", "input": {"to": "a@example.com", "subject": "s", "body": "b"}}
    model.set_scripts({"mail": [{"tool_calls": [email]}, {"text": "Sent."}]})
    try:
        pool.start(1)
        deadline = time.monotonic() + 60
        while "durability guard:" not in pool.logs():
            assert time.monotonic() < deadline, pool.logs()
            time.sleep(0.05)
        # The decision made at start is now stale: the next guarded turn is decided again.
        time.sleep(durability.RECHECK + 0.5)
        probes_before = int(admin.get(DURABILITY_PROBE) or 0)
        started = time.monotonic()
        runs = [
            enqueue_run("pool_agents:support", script_task("mail", f"task {i}"), connection=admin) for i in range(6)
        ]
        for run_id in runs:
            assert wait_for_run(run_id, timeout=60, connection=admin).status == "completed", pool.logs()
        elapsed = time.monotonic() - started
        probes = int(admin.get(DURABILITY_PROBE) or 0) - probes_before
        assert len([e for e in pool.effects() if e["tool"] == "send_email"]) == 6
        assert probes <= 1 + int(elapsed // durability.RECHECK), (
            f"{probes} decision probes for 6 guarded turns in {elapsed:.1f} s: {pool.logs()}"
        )
    finally:
        pool.stop()
        admin.close()
        server.stop()
