"""Redis behind Sentinel: a primary, a replica and a sentinel started here, a pool of real workers on a
``redis+sentinel://`` URL, and the primary SIGKILLed under load. The sentinel promotes the replica;
the workers' clients follow it without a restart. Effects are counted outside the pool (a file)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from agentpool import enqueue_run, wait_for_run
from agentpool.runtime import sentinel
from agentpool.runtime.settings import BadRedisUrl, check_redis_url, connect, redact_url
from agentpool.testing.replicated import ReplicatedRedis

from conftest import Pool, assert_valid_conversation, script_task

pytestmark = pytest.mark.failover

EFFECTS = [
    {
        "delay": 0.05,
        "tool_calls": [{"name": "send_email", "input": {"to": "a@example.com", "subject": "s", "body": "b"}}],
    },
    {"delay": 0.05, "tool_calls": [{"name": "create_ticket", "input": {"title": "t", "body": "b"}}]},
    {
        "delay": 0.05,
        "tool_calls": [{"name": "send_email", "input": {"to": "b@example.com", "subject": "s", "body": "b"}}],
    },
    {"text": "All done."},
]


@pytest.fixture
def replicated(tmp_path, request):
    # The sentinel asks for a password of its own, as managed ones do: every client here gives it.
    # One replica, or the two a Sentinel deployment normally runs (``@pytest.mark.parametrize("replicated",
    # [2], indirect=True)``): with two, the failover leaves the new primary a replica and nothing may stall.
    replicas = getattr(request, "param", 1)
    servers = ReplicatedRedis(tmp_path / "redis", sentinel_password="sen@tinel-s3cret", replicas=replicas).start()
    yield servers
    servers.stop()


@pytest.fixture
def ha_pool(replicated, model, tmp_path):
    pool = Pool(replicated.url, model, tmp_path)
    yield pool
    pool.stop()


def _assert_effects_once(pool: Pool, run_ids: list[str]) -> None:
    effects = [e for e in pool.effects() if e.get("run") in run_ids]
    emails = Counter((e["run"], e["to"]) for e in effects if e["tool"] == "send_email")
    repeated = {k: n for k, n in emails.items() if n > 1}
    assert not repeated, f"unsafe effects repeated: {repeated}"
    keys: dict[str, set[str]] = defaultdict(set)
    for e in effects:
        if e["tool"] == "create_ticket":
            keys[e["run"]].add(e["key"])
    assert all(len(k) == 1 for k in keys.values()), f"an idempotent effect under two keys: {dict(keys)}"


def _run_through(pool: Pool, model, r, run_ids: list[str]) -> None:
    runs = [wait_for_run(run_id, timeout=120, connection=r) for run_id in run_ids]
    done = [run for run in runs if run.status == "completed"]
    assert len(done) == len(run_ids), ([(run.id, run.status, run.error) for run in runs], pool.logs())
    for run in runs:
        assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    _assert_effects_once(pool, run_ids)


TWO_REPLICAS = pytest.mark.parametrize("replicated", [2], indirect=True, ids=["two_replicas"])


def test_runs_complete_without_repeated_effects_when_the_primary_is_killed(replicated, ha_pool, model):
    _kill_under_load(replicated, ha_pool, model, restart=True)


@TWO_REPLICAS
def test_with_two_replicas_runs_complete_when_the_primary_is_killed_and_never_comes_back(replicated, ha_pool, model):
    """As Sentinel deployments run: the failover leaves the new primary a replica, so the guard is met
    again without the old primary's return, and no run stalls."""
    _kill_under_load(replicated, ha_pool, model, restart=False)


def _kill_under_load(replicated, ha_pool, model, *, restart: bool) -> None:
    model.set_scripts({"effects": EFFECTS})
    ha_pool.start(3)
    r = ha_pool.client()
    run_ids = [enqueue_run("pool_agents:support", script_task("effects", f"task {i}"), connection=r) for i in range(20)]
    deadline = time.monotonic() + 60
    while len(ha_pool.effects()) < 15:  # mid-load: some runs past their first effects, most not
        assert time.monotonic() < deadline, ha_pool.logs()
        time.sleep(0.01)
    replicated.kill_primary(restart=restart)
    _run_through(ha_pool, model, r, run_ids)


def test_a_tool_whose_intent_only_the_primary_had_never_ran(replicated, ha_pool, model):
    """Replication cut under load (the replica's link partitioned), the primary SIGKILLed while it is,
    the replica promoted: it lacks every write made meanwhile. A tool may have run only if its intent
    and save point A reached the replica first, so none of them runs twice."""
    _cut_then_kill(replicated, ha_pool, model, restart=True)


@TWO_REPLICAS
def test_with_two_replicas_cut_off_a_tool_whose_intent_only_the_primary_had_never_ran(replicated, ha_pool, model):
    """Both replicas cut off, the primary killed for good: the sentinel promotes one and points the
    other at it, so the guard is met again and nothing stalls."""
    _cut_then_kill(replicated, ha_pool, model, restart=False)


# Slower model calls for the cut: the runs must still have tools to run once the cut lands, even when
# a loaded machine keeps this test's process from making it for a few seconds.
SLOW_EFFECTS = [{**step, "delay": 0.2} if "delay" in step else step for step in EFFECTS]


def _cut_then_kill(replicated, ha_pool, model, *, restart: bool) -> None:
    model.set_scripts({"effects": SLOW_EFFECTS})
    # The cut waits for the sentinel's first fix of the replicas (about 10 s after start): the runs
    # start once it is done, so that they still have tools to run when the cut lands.
    replicated.wait_for_sentinel_fix()
    ha_pool.start(3)
    r = ha_pool.client()
    run_ids = [enqueue_run("pool_agents:support", script_task("effects", f"task {i}"), connection=r) for i in range(15)]
    deadline = time.monotonic() + 60
    while len(ha_pool.effects()) < 3:
        assert time.monotonic() < deadline, ha_pool.logs()
        time.sleep(0.01)
    replicated.cut_replication()
    # One run more, enqueued after the cut: on a loaded machine the runs above may have run every tool
    # before the cut landed, but this one's email needs the cut-off replica's acknowledgement, so a
    # refusal comes whatever the timing. Its enqueue reached the primary alone, so the failover may lose
    # it with the rest written meanwhile: it is not among the runs checked after.
    enqueue_run("pool_agents:support", script_task("effects", "after the cut"), connection=r)
    # The workers go on against the primary alone until the guard has refused a tool for want of the
    # replica. Its hand-back event is written to the primary and lost with it, so the worker's log says.
    deadline = time.monotonic() + 60
    while "handed back (not_replicated)" not in ha_pool.logs(tail=1_000_000):
        assert time.monotonic() < deadline, "no tool waited for the cut-off replica: " + ha_pool.logs()
        time.sleep(0.05)
    replicated.kill_primary(restart=restart)
    _run_through(ha_pool, model, r, run_ids)


def test_runs_a_failover_left_without_a_replica_wait_visibly_and_go_on_once_one_is_back(replicated, ha_pool, model):
    """One replica, promoted; the old primary does not come back: no replica can acknowledge, so the
    tools with an effect wait (never run unguarded). The wait is visible: get_run, `agentpool runs`,
    `agentpool check` and a metric say so, with since when; it ends once a replica is back."""
    from agentpool import get_run
    from agentpool.ops.metrics import PoolCollector

    model.set_scripts({"effects": EFFECTS})
    ha_pool.start(2, AGENTPOOL_REPLICA_ACK_TIMEOUT="0.3")
    r = ha_pool.client()
    run_ids = [enqueue_run("pool_agents:support", script_task("effects", f"task {i}"), connection=r) for i in range(3)]
    deadline = time.monotonic() + 60
    while len(ha_pool.effects()) < 2:
        assert time.monotonic() < deadline, ha_pool.logs()
        time.sleep(0.01)
    old = replicated.primary_port()
    replicated.kill_primary(restart=False)

    def waiting_runs() -> list:
        runs = [get_run(run_id, connection=r) for run_id in run_ids]
        return [run for run in runs if (run.waiting or {}).get("kind") == "waiting_for_replica"]

    _wait_for(lambda: waiting_runs(), "no run says it waits for a replica", timeout=60)
    run = waiting_runs()[0]
    assert run.status == "running" and run.waiting["reason"] == "not_replicated", run.waiting
    assert run.waiting["since"] <= time.time() and "waiting for a replica to acknowledge since" in run.waiting["note"]
    assert "AGENTPOOL_REPLICA_ACKS" in run.waiting["note"]
    env = {**ha_pool.env}
    listing, checking = (  # both at once: each CLI process takes seconds to start on a loaded machine
        subprocess.Popen(
            [sys.executable, "-m", "agentpool", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in (["runs"], ["check", "--strict"])
    )
    listed, _ = listing.communicate(timeout=60)
    assert "waiting for a replica to acknowledge" in listed, listed
    _, warned = checking.communicate(timeout=60)
    assert checking.returncode == 1 and "the durability guard cannot be met" in warned, warned
    metrics = {m.name: m for m in PoolCollector(r).collect()}
    assert metrics["agentpool_runs_waiting_for_replica"].samples[0].value >= 1
    assert metrics["agentpool_replica_wait_seconds"].samples[0].value > 0

    replicated.restart_as_replica(old)  # what the docs tell an operator to do
    _run_through(ha_pool, model, r, run_ids)
    checked = subprocess.run(
        [sys.executable, "-m", "agentpool", "check", "--strict"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr


def test_the_cli_and_rq_info_reach_redis_through_sentinel(replicated, ha_pool, model):
    model.set_scripts({})
    ha_pool.start(1)
    r = ha_pool.client()
    run_id = enqueue_run("pool_agents:support", "hello", connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
    env = {**ha_pool.env}
    table = subprocess.run(
        [sys.executable, "-m", "agentpool", "runs"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert table.returncode == 0 and run_id in table.stdout, table.stderr
    info = subprocess.run(
        [str(Path(sys.executable).parent / "rq"), "info", "-c", "agentpool.rqconfig"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert info.returncode == 0 and "agentpool" in info.stdout, info.stdout + info.stderr
    assert "1 workers" in info.stdout or "1 worker" in info.stdout, info.stdout

    # Without the sentinel's password, or with a master name it does not know: one line that says so.
    for url, said in (
        (replicated.url.split("?")[0], "give theirs with ?sentinel_password="),
        (replicated.url.replace("/agentpool/", "/nosuch/"), "no sentinel knows a primary named 'nosuch'"),
    ):
        refused = subprocess.run(
            [sys.executable, "-m", "agentpool", "runs"],
            env={**env, "REDIS_URL": url},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert refused.returncode == 1 and said in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1 and "<redis.client" not in refused.stderr, refused.stderr


def test_a_sentinel_url_is_parsed_and_never_shows_its_password():
    target = sentinel.parse("redis+sentinel://app:s3cr%40t@h1:26380,h2/pool/2")
    assert target.instances == (("h1", 26380), ("h2", 26379))
    assert (target.master, target.db, target.username, target.password) == ("pool", 2, "app", "s3cr@t")
    assert redact_url("redis+sentinel://app:s3cret@h1,h2/pool") == "redis+sentinel://app:***@h1,h2/pool"
    with pytest.raises(BadRedisUrl) as bad:
        check_redis_url("redis+sentinel://app:s3cret@h1/")
    assert "s3cret" not in str(bad.value) and "<master name>" in str(bad.value)
    assert sentinel.rq_settings("redis+sentinel://h1:1/pool/3")["INSTANCES"] == [("h1", 1)]
    guarded = "redis+sentinel://app:s3cret@h1/pool?sentinel_username=sen&sentinel_password=p%40ss"
    target = sentinel.parse(guarded)
    assert (target.sentinel_username, target.sentinel_password) == ("sen", "p@ss")
    assert "p%40ss" not in redact_url(guarded) and "sentinel_password=***" in redact_url(guarded)
    assert "p@ss" not in repr(target) and "s3cret" not in repr(target)
    kwargs = sentinel.rq_settings(guarded)["SENTINEL_KWARGS"]
    assert (kwargs["username"], kwargs["password"]) == ("sen", "p@ss")
    with pytest.raises(BadRedisUrl) as bad:
        check_redis_url("redis+sentinel://h1/pool?sentinel_pasword=p%40ss")
    # A misspelt option is not named (an unknown "option" may be the end of a password holding an
    # unencoded "&"); the known ones are listed instead.
    assert "p%40ss" not in str(bad.value) and "sentinel_pasword" not in str(bad.value)
    assert "unknown query option (known: sentinel_username, sentinel_password)" in str(bad.value)


def _wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_auto_waits_for_a_replica_once_the_deployment_has_one_and_never_stops(tmp_path, monkeypatch):
    """`AGENTPOOL_REPLICA_ACKS=auto`: none on a lone Redis; one once a replica attached (also a replica
    added after the workers started); still one after it disconnected: a lost replica makes tools
    wait, it never switches the guard off."""
    from agentpool.runtime import durability
    from agentpool.runtime.settings import Settings
    from agentpool.testing.localpool import RedisServer

    (tmp_path / "p").mkdir()
    (tmp_path / "q").mkdir()
    primary = RedisServer(tmp_path / "p").start()
    replica = RedisServer(tmp_path / "q", extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    r = connect(primary.url)
    settings = Settings.from_env()
    monkeypatch.setattr(durability, "_decided", None)
    monkeypatch.setattr(durability, "RECHECK", 0.0)
    try:
        assert settings.replica_acks == "auto"
        assert durability.guard(r, settings).replicas == 0, "a lone Redis: no wait"
        replica.start()
        _wait_for(lambda: int(r.info("replication")["connected_slaves"]) == 1, "the replica never attached")
        assert durability.guard(r, settings).replicas == 1, "a replica added after start is waited for"
        replica.stop()
        _wait_for(lambda: int(r.info("replication")["connected_slaves"]) == 0, "the replica never left")
        assert durability.decide(r, settings).replicas == 1, "a worker started now still waits"
        assert durability.guard(r, settings).replicas == 1
    finally:
        r.close()
        replica.stop()
        primary.stop()


def test_auto_tells_a_deployment_with_replicas_from_a_lone_redis_where_info_is_refused(tmp_path):
    """An ACL user without @dangerous (deploy/README.md's) cannot read INFO: the guard then asks the
    replicas themselves with a probe write, so a lone Redis does not make every tool wait forever for
    a replica it will never have, and one with a replica is still guarded."""
    from redis.exceptions import NoPermissionError

    from agentpool.runtime import durability
    from agentpool.runtime.settings import Settings
    from agentpool.testing.localpool import RedisServer

    (tmp_path / "p").mkdir()
    (tmp_path / "q").mkdir()
    primary = RedisServer(tmp_path / "p").start()
    replica = RedisServer(tmp_path / "q", extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    admin = connect(primary.url)
    admin.execute_command("ACL", "SETUSER", "limited", "reset", "on", ">pw", "~*", "&*", "+@all", "-@dangerous")
    limited = connect(primary.url.replace("redis://", "redis://limited:pw@"))
    settings = Settings.from_env()
    try:
        with pytest.raises(NoPermissionError):
            limited.info("replication")
        assert durability.decide(limited, settings).replicas == 0, "a lone Redis: no wait"
        replica.start()
        _wait_for(lambda: int(admin.info("replication")["connected_slaves"]) == 1, "the replica never attached")
        _wait_for(lambda: durability.decide(limited, settings).replicas == 1, "a replica was not seen", timeout=10)
    finally:
        limited.close()
        admin.close()
        replica.stop()
        primary.stop()
