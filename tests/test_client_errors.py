"""The client API's errors, the same on every path: a shard that refuses the password is said as one
Redis says it, a cancel leaves a run tree from a newer agentpool untouched, the async wait refuses the
timeouts the sync one refuses, and a watch that loses Redis raises the API's own error. Real
redis-servers, real workers and the scripted model."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest
import redis.asyncio as aredis
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError
from redis.retry import Retry
from test_usability import agentpool_cli

from agentpool import (
    RedisUnreachable,
    SchemaTooNew,
    Shards,
    aio,
    cancel_run,
    enqueue_run,
    get_run,
    list_runs,
    wait_for_run,
    watch,
)
from agentpool.client import RunTimeout
from agentpool.runtime.settings import RedisCredentialsRefused
from agentpool.store.keys import RunKeys
from agentpool.store.records import SCHEMA_VERSION
from agentpool.testing.localpool import free_port

from conftest import _redis_server, run_loop, script_task, wait_for_status

AGENT = "pool_agents:support"


@pytest.fixture
def wrong_password_on_shard_1(r, redis_server):
    """Shard 0 the suite's Redis (db 0, no password), shard 1 its db 1 as an ACL user: the pool with the
    right password and the URLs of a pool whose shard 1 has it wrong."""
    r.acl_setuser("app-user", enabled=True, passwords=["+right-pw"], commands=["+@all"], keys=["*"])
    where = redis_server.url.split("://", 1)[1].rsplit("/", 1)[0]  # 127.0.0.1:PORT
    right = [redis_server.url, f"redis://app-user:right-pw@{where}/1"]
    with Redis.from_url(right[1]) as shard_1:
        shard_1.flushdb()
    try:
        yield Shards(right), [right[0], right[1].replace("right-pw", "wrong-pw")]
    finally:
        r.acl_deluser("app-user")


def test_a_shard_refusing_the_password_is_said_at_once_naming_it_not_called_unreachable(wrong_password_on_shard_1):
    """On one Redis a wrong password is RedisCredentialsRefused at once; on a sharded pool the shard
    lookup took it for a silent shard: "Redis unreachable at shard 1 ..., which may hold run ..."."""
    good, urls = wrong_password_on_shard_1
    on_1 = next(
        run_id for run_id in (enqueue_run(AGENT, "t", connection=good) for _ in range(6)) if run_id[-3:] == "-s1"
    )
    pool = Shards(urls)
    calls = {
        "get_run": lambda run_id: get_run(run_id, connection=pool),
        "cancel_run": lambda run_id: cancel_run(run_id, connection=pool),
        "wait_for_run": lambda run_id: wait_for_run(run_id, timeout=5, connection=pool),
        "watch": lambda run_id: next(iter(watch(run_id, connection=pool))),
    }
    for name, call in calls.items():
        for run_id in (on_1, "nowhere-1"):  # found on the refusing shard, or on no shard
            started = time.monotonic()
            with pytest.raises(RedisCredentialsRefused) as refused:
                call(run_id)
            assert time.monotonic() - started < 2, f"{name}: not retried"
            message = str(refused.value)
            assert message.startswith("Redis at shard 1 (redis://app-user:***@127.0.0.1:"), (name, message)
            assert "refused the credentials: " in message and "unreachable" not in message, (name, message)
            assert "wrong-pw" not in message
            assert refused.value.shard == 1
            assert isinstance(refused.value, RedisUnreachable) and isinstance(refused.value, AuthenticationError)
    assert good.clients[1].hget(RunKeys.of(on_1).run, "status") == b"queued", "nothing was cancelled"
    with pytest.raises(RedisCredentialsRefused, match="refused the credentials: "):
        list_runs(connection=pool)

    async def app() -> None:
        shards = Shards([aio.connect(url) for url in urls])
        with pytest.raises(
            RedisCredentialsRefused, match=r"^Redis at shard 1 \(redis://127.0.0.1:\d+/1\) refused the credentials: "
        ):
            await aio.get_run(on_1, connection=shards)
        with pytest.raises(RedisCredentialsRefused, match="refused the credentials: "):  # as the sync list_runs
            await aio.list_runs(connection=shards)
        for member in shards.members:
            await member.aclose()

    run_loop(app())

    env = {"AGENTPOOL_SHARDS": " ".join(urls)}
    out = agentpool_cli("show", on_1, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "refused the credentials" in line and "unreachable" not in line and "wrong-pw" not in line, line
    assert "at shard 1, " in line and urls[0].split("//")[1] not in line, "it names the shard at fault, only"


OVERSEE = {
    "oversee": [
        {"tool_calls": [{"name": "deployer", "input": {"task": "deploy 9 [script:dep]"}}]},
        {"text": "overseen"},
    ],
    "dep": [{"tool_calls": [{"name": "deploy", "input": {"version": "9"}}]}, {"text": "deployed"}],
}


def _snapshot(r: Redis, *run_ids: str) -> dict[str, bytes | None]:
    keys = [RunKeys.of(run_id) for run_id in run_ids]
    return {name: r.dump(name) for k in keys for name in (k.run, k.events, k.messages, k.children, k.joins)}


def test_cancel_refuses_a_run_tree_a_newer_agentpool_wrote_and_changes_nothing(r, redis_server, pool, model):
    """During a rolling deploy a newer agentpool's record may mean something by its status this one does
    not know: cancel overwrote it (the parent's, or a child's once the parent was cancelled)."""
    model.set_scripts(OVERSEE)
    (worker,) = pool.start(1)
    parent = enqueue_run("subagent_agents:overseer", script_task("oversee"), connection=r)
    (child,) = wait_for_run(parent, timeout=120, connection=r).children
    wait_for_status(r, child, "waiting_approval")
    pool.kill(worker)  # nothing moves while the cancels are refused

    async def aio_cancel() -> None:
        a = aredis.Redis.from_url(redis_server.url)
        try:
            await aio.cancel_run(parent, connection=a)
        finally:
            await a.aclose()

    for newer in (parent, child):
        r.hset(RunKeys.of(newer).run, "v", SCHEMA_VERSION + 1)
        before = _snapshot(r, parent, child)
        which = "it" if newer == parent else f"its child run {newer}"
        wanted = f"run {parent} cannot be cancelled here: {which} was written with schema version {SCHEMA_VERSION + 1}"
        with pytest.raises(SchemaTooNew, match=wanted):
            cancel_run(parent, connection=r)
        with pytest.raises(SchemaTooNew, match=wanted):
            run_loop(aio_cancel())
        out = pool.cli("cancel", parent)
        assert out.returncode == 1 and out.stderr.startswith(f"error: {wanted}"), out.stderr
        assert _snapshot(r, parent, child) == before, f"{newer}: the tree is left as found"
        r.hset(RunKeys.of(newer).run, "v", SCHEMA_VERSION)

    assert cancel_run(parent, connection=r) == "waiting_children", "this agentpool's own tree is cancelled"
    assert [get_run(run_id, connection=r).status for run_id in (parent, child)] == ["cancelled", "cancelled"]


def test_a_child_a_newer_agentpool_rewrote_after_cancel_looked_is_left_and_the_caller_told(r, pool, model):
    """The race the look before a cancel leaves: a child run rewritten by a newer worker after
    ``cancel_run`` walked the tree, before its own cancel. The parent is cancelled (its cancel came
    first), the child left as found, and the caller told that the parent was cancelled and which child
    was not: the child's own refusal, raised from the middle of the tree, did not say the parent had been
    cancelled, and no child after it was."""
    from agentpool.client import _cancel  # the cancel after the look: the race, made deterministic

    model.set_scripts(OVERSEE)
    (worker,) = pool.start(1)
    parent = enqueue_run("subagent_agents:overseer", script_task("oversee"), connection=r)
    (child,) = wait_for_run(parent, timeout=120, connection=r).children
    wait_for_status(r, child, "waiting_approval")
    pool.kill(worker)
    r.hset(RunKeys.of(child).run, "v", SCHEMA_VERSION + 1)
    before = _snapshot(r, child)

    wanted = f"run {parent} was cancelled, but not all the runs below it: a newer agentpool wrote child run(s) {child}"
    with pytest.raises(SchemaTooNew, match=re.escape(wanted)):
        _cancel(r, parent, "cancelled by request")
    assert get_run(parent, connection=r).status == "cancelled"
    assert _snapshot(r, child) == before, "the newer agentpool's child is left as found"


def test_the_async_wait_for_run_refuses_what_the_sync_one_refuses_and_says_why_it_timed_out(r, redis_server):
    """The async wait took any timeout: NaN (or a poll of 0) waited for ever, None failed midway with a
    bare TypeError, -1 timed out at once; and its RunTimeout did not say what the run waits for."""
    idle = enqueue_run(AGENT, "no worker serves this queue", connection=r, queue="nobody")
    bad_waits = [{"timeout": bad} for bad in (float("nan"), None, -1, float("inf"), "60", True)]
    bad_waits += [{"timeout": 1, "poll": 0}, {"timeout": 1, "poll": float("nan")}]
    refused = {}
    for wait in bad_waits:
        with pytest.raises(ValueError, match="(timeout|poll) must be") as sync_error:
            wait_for_run(idle, connection=r, **wait)
        refused[str(wait)] = str(sync_error.value)

    async def app() -> tuple[dict[str, str], str]:
        a = aredis.Redis.from_url(redis_server.url)
        said = {}
        for wait in bad_waits:
            try:
                # wait_for bounds a NaN timeout; not a poll of 0, whose cancel redis.asyncio can swallow
                await asyncio.wait_for(aio.wait_for_run(idle, connection=a, **wait), 5)
            except ValueError as exc:
                said[str(wait)] = str(exc)
            except (RunTimeout, TypeError, TimeoutError) as exc:
                said[str(wait)] = f"not refused: {type(exc).__name__}"
        with pytest.raises(RunTimeout) as timed_out:
            await aio.wait_for_run(idle, timeout=0.3, connection=a)
        await a.aclose()
        return said, str(timed_out.value)

    said, timed_out = run_loop(app())
    assert said == refused
    with pytest.raises(RunTimeout) as sync_timed_out:
        wait_for_run(idle, timeout=0.3, connection=r)
    assert timed_out == str(sync_timed_out.value)
    assert timed_out.startswith(f"run {idle} still queued after 0.3 s (turn 0): waiting for a worker"), timed_out


def test_a_watch_that_cannot_reach_redis_raises_redis_unreachable_naming_it(tmp_path):
    """watch raised redis-py's bare ConnectionError where every other call raises RedisUnreachable naming
    the server: at its first read, and when Redis goes away while it follows a run."""
    port = free_port()  # nothing listens there
    where = f"redis://127.0.0.1:{port}/0"
    nowhere = Redis.from_url(f"redis://app:s3cret-pw@127.0.0.1:{port}/0")
    with nowhere, pytest.raises(RedisUnreachable, match=f"^Redis unreachable at {where}: ") as unreachable:
        next(iter(watch("r_x", connection=nowhere)))
    assert "s3cret-pw" not in str(unreachable.value)

    server = _redis_server(tmp_path).start()
    client = Redis.from_url(server.url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2)
    try:
        run_id = enqueue_run(AGENT, "no worker takes it", connection=client, queue="nobody")
        following = watch(run_id, connection=client, block_ms=100)
        assert next(following)["type"] == "status"
        server.stop(signal.SIGKILL)  # Redis gone while a run is followed
        with pytest.raises(RedisUnreachable, match=f"^Redis unreachable at redis://127.0.0.1:{server.port}/0: "):
            for _ in following:
                pass
    finally:
        client.close()
        server.stop()

    async def app() -> None:
        a = aredis.Redis.from_url(f"redis://app:s3cret-pw@127.0.0.1:{port}/0")
        with pytest.raises(RedisUnreachable, match=f"^Redis unreachable at {where}: ") as unreachable:
            async for _ in aio.watch("r_x", connection=a):
                pass
        assert "s3cret-pw" not in str(unreachable.value)
        await a.aclose()

    run_loop(app())
