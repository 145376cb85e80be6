"""agentpool.aio: the app-facing API as coroutines on a redis.asyncio client, against the test's real
Redis and real worker processes. Each test runs its app code in one event loop (asyncio.run)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis.asyncio as aredis
from redis import Redis
from redis.asyncio.sentinel import Sentinel

from agentpool import RedisUnreachable, RunExists, RunNotFound, Shards, aio
from agentpool import enqueue_run as sync_enqueue_run
from agentpool import get_run as sync_get_run
from agentpool import list_runs as sync_list_runs
from agentpool.testing import LocalPool
from agentpool.testing.localpool import RedisServer, free_port
from agentpool.testing.replicated import MASTER, ReplicatedRedis

from conftest import TESTS, assert_valid_conversation, run_loop, script_task

APPROVAL = [
    {"tool_calls": [{"name": "deploy", "input": {"version": "2.4.1"}}]},
    {"text": "Deployed 2.4.1."},
    {"text": "You said: thanks."},
]


def _client(redis_server, **kwargs) -> aredis.Redis:
    return aredis.Redis.from_url(redis_server.url, **kwargs)


def test_an_asyncio_app_starts_watches_approves_messages_and_forks_a_run(r, redis_server, pool, model):
    model.set_scripts({"approve": APPROVAL})
    pool.start(1)

    async def app() -> dict:
        a = _client(redis_server, decode_responses=True)  # an app's usual client: text replies
        run_id = await aio.enqueue_run("pool_agents:guarded", script_task("approve"), connection=a)
        seen = []
        async for item in aio.watch(run_id, connection=a):
            seen.append(item)
            if item["type"] == "status" and item.get("status") == "waiting_approval":
                break
        waiting = await aio.get_run(run_id, connection=a)
        decided = await aio.approve(run_id, connection=a)
        done = await aio.wait_for_run(run_id, timeout=120, connection=a)
        message_id = await aio.send_message(run_id, "thanks", connection=a)
        answered = await aio.wait_for_run(run_id, timeout=120, connection=a, after_message=message_id)
        fork_id = await aio.fork_run(run_id, at_turn=1, connection=a)
        fork = await aio.get_run(fork_id, connection=a)
        # The fork goes on in the pool's worker: the lists below compare records that no longer move.
        await aio.wait_for_run(fork_id, timeout=120, connection=a)
        listed = await aio.list_runs(connection=a, limit=10)
        tree = await aio.run_tree(run_id, connection=a)
        await a.aclose()
        await aio.aclose()  # the bytes twin agentpool.aio keeps beside a decode_responses client
        return locals()

    got = run_loop(app())
    assert [c["name"] for c in got["waiting"].awaiting_approval] == ["deploy"]
    assert got["decided"] == [got["waiting"].awaiting_approval[0]["id"]]
    assert got["done"].status == "completed" and got["done"].result == "Deployed 2.4.1.", pool.logs()
    assert got["answered"].result == "You said: thanks."
    assert_valid_conversation(got["answered"].messages)
    assert got["answered"] == sync_get_run(got["run_id"], connection=r), "the same record as the sync API reads"
    assert got["fork"].forked_from == got["run_id"] and got["fork"].forked_at == 1
    assert "turn_started" in [item["type"] for item in got["seen"]]
    assert [run.id for run in got["listed"]] == [got["fork_id"], got["run_id"]], "newest first"
    assert got["listed"] == sync_list_runs(connection=r, limit=10)
    assert got["tree"]["id"] == got["run_id"] and got["tree"]["status"] == "completed" and got["tree"]["children"] == []


def test_a_watch_waiting_on_redis_does_not_block_the_loop(redis_server):
    """While the watch of an idle run sits in its blocking XREAD, another coroutine of the same loop runs
    and sees, from Redis itself, that read blocked: it could not if the read held the loop."""

    async def app() -> tuple[list, bool]:
        a = _client(redis_server)
        idle = await aio.enqueue_run("pool_agents:support", "wait for me", connection=a)  # no worker: stays queued
        watching = asyncio.create_task(_items(aio.watch(idle, connection=a, block_ms=4000, live_output=False)))
        seen_blocked = False
        for _ in range(3000):
            clients = await a.client_list()
            if any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in clients):
                seen_blocked = True
                break
            await asyncio.sleep(0.01)
        await aio.cancel_run(idle, connection=a)
        items = await asyncio.wait_for(watching, 120)
        await a.aclose()
        return items, seen_blocked

    items, seen_blocked = run_loop(app())
    assert seen_blocked, "the loop ran while the watch's XREAD was blocked in Redis"
    assert items[-1]["type"] == "status" and items[-1]["status"] == "cancelled"


async def _items(iterator) -> list:
    return [item async for item in iterator]


def test_the_async_api_raises_the_sync_apis_errors_and_refuses_a_sync_client(r, redis_server):
    async def app() -> None:
        a = _client(redis_server)
        with pytest.raises(RunNotFound):
            await aio.get_run("r_nothere", connection=a)
        await aio.enqueue_run("pool_agents:support", "one", run_id="r_aio1", connection=a)
        assert await aio.enqueue_run("pool_agents:support", "one", run_id="r_aio1", connection=a) == "r_aio1"
        with pytest.raises(RunExists):
            await aio.enqueue_run("pool_agents:support", "another", run_id="r_aio1", connection=a)
        with pytest.raises(TypeError, match="redis.asyncio client"):
            await aio.get_run("r_aio1", connection=r)
        with pytest.raises(aio.client.RunTimeout):
            await aio.wait_for_run("r_aio1", timeout=0, connection=a)
        await a.aclose()

    run_loop(app())


def test_without_a_connection_the_async_api_reads_redis_url(redis_server, monkeypatch):
    monkeypatch.setenv("REDIS_URL", redis_server.url)

    async def app() -> str:
        run_id = await aio.enqueue_run("pool_agents:support", "from the environment")
        status = (await aio.get_run(run_id)).status
        await aio.aclose()  # the client agentpool.aio made from REDIS_URL
        return status

    assert run_loop(app()) == "queued"


def test_without_the_aio_extra_importing_agentpool_aio_names_the_extra():
    import subprocess
    import sys

    code = "import sys; sys.modules['greenlet'] = None\nimport agentpool\ntry:\n    import agentpool.aio\nexcept ImportError as exc:\n    print(exc)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "agentpool.aio needs the aio extra: pip install 'agentpool[aio]'\n", out.stderr


def test_list_runs_on_a_sharded_pool_merges_every_shards_runs_as_the_sync_call_does(tmp_path, monkeypatch):
    """The sync list_runs reads the shards in threads, where a bridged client cannot be used: the async
    one reads every shard on the loop, merged newest first, and a shard that does not answer is a
    RedisUnreachable naming it."""
    with LocalPool(shards=2, workers=0, cwd=TESTS) as pool:
        made = [sync_enqueue_run("pool_agents:support", f"task {i}", connection=pool.redis) for i in range(4)]
        assert {run_id[-3:] for run_id in made} == {"-s0", "-s1"}, "new runs go round the shards"
        monkeypatch.setenv("AGENTPOOL_SHARDS", " ".join(pool.redis_urls))
        dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

        async def app() -> dict:
            mine = Shards([aredis.Redis.from_url(url, decode_responses=True) for url in pool.redis_urls])
            newest = await aio.list_runs(connection=mine, limit=3)
            every = await aio.list_runs()  # AGENTPOOL_SHARDS's
            with pytest.raises(RedisUnreachable, match=r"shard 1 \(redis://127\.0\.0\.1:\d+/0\)") as silent:
                await aio.list_runs(connection=Shards([mine.members[0], aredis.Redis.from_url(dead)]))
            for member in mine.members:
                await member.aclose()
            await aio.aclose()
            return {"newest": newest, "every": every, "silent": str(silent.value)}

        got = run_loop(app())
        assert got["newest"] == sync_list_runs(connection=pool.redis, limit=3)
        assert got["every"] == sync_list_runs(connection=pool.redis), "every shard's runs, newest first"
        assert sorted(run.id for run in got["every"]) == sorted(made)
        assert dead.removesuffix("/0") in got["silent"]


def test_enqueue_run_inside_an_apps_span_puts_the_run_in_the_apps_trace(redis_server, pool, model, tmp_path):
    """The sync code runs in a greenlet, which starts with an empty context unless it is given the
    caller's: the app's current span must reach enqueue_run as it does from the sync API."""
    from opentelemetry.sdk.trace import TracerProvider

    from agentpool.testing.spans import read_spans

    model.set_scripts({"traced": [{"text": "Hi."}]})
    spans_file = tmp_path / "spans.jsonl"
    pool.start(1, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file))
    app_tracer = TracerProvider().get_tracer("the-app")  # not installed globally: its span is made current

    async def app() -> tuple:
        a = _client(redis_server)
        with app_tracer.start_as_current_span("POST /runs") as request_span:
            run_id = await aio.enqueue_run("pool_agents:support", script_task("traced"), connection=a)
        run = await aio.wait_for_run(run_id, timeout=120, connection=a)
        await a.aclose()
        return request_span.get_span_context(), run

    app_ctx, run = run_loop(app())
    assert run.status == "completed", pool.logs()
    deadline = time.monotonic() + 60
    while not (roots := [s for s in read_spans(str(spans_file)) if s["name"] == "invoke_agent pool_agents:support"]):
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.1)
    assert roots[0]["trace_id"] == f"{app_ctx.trace_id:032x}", "the run is in the app's trace"
    assert roots[0]["parent_id"] == f"{app_ctx.span_id:016x}", "under the app's span"


def test_the_bytes_twin_of_a_decode_responses_client_keeps_its_pools_limit(redis_server):
    """agentpool reads bytes, so beside a decode_responses=True client it keeps a bytes copy: with the
    app's pool size, or concurrent calls would open as many connections as they like."""

    async def app() -> list[dict]:
        app_pool = aredis.BlockingConnectionPool.from_url(
            redis_server.url, decode_responses=True, max_connections=1, timeout=30, client_name="aio-limited"
        )
        a = aredis.Redis(connection_pool=app_pool)
        run_id = await aio.enqueue_run("pool_agents:support", "limited", connection=a)
        runs = await asyncio.gather(*(aio.get_run(run_id, connection=a) for _ in range(8)))
        assert {run.status for run in runs} == {"queued"}
        async with _client(redis_server) as plain:
            named = [c for c in await plain.client_list() if c["name"] == "aio-limited"]
        await a.aclose()
        await aio.aclose()
        return named

    named = run_loop(app())
    assert len(named) <= 2, f"the app's connection and at most one of the twin's: {named}"


def test_a_decode_responses_sentinel_client_is_accepted(tmp_path):
    """The docs' client for a Sentinel deployment: redis.asyncio.sentinel's master_for, as an app makes it
    (text replies): its bytes twin follows the same primary through the same sentinels."""
    servers = ReplicatedRedis(tmp_path / "redis").start()
    try:

        async def app() -> str:
            sentinels = Sentinel([("127.0.0.1", servers.sentinel_port)])
            a = sentinels.master_for(MASTER, decode_responses=True)
            run_id = await aio.enqueue_run("pool_agents:support", "through sentinel", connection=a)
            status = (await aio.get_run(run_id, connection=a)).status
            await a.aclose()
            await aio.aclose()
            for asked in sentinels.sentinels:
                await asked.aclose()
            return status

        assert run_loop(app()) == "queued"
    finally:
        servers.stop()


def test_a_loops_default_client_is_closed_when_the_loop_ends(tmp_path, monkeypatch):
    """A loop's client from REDIS_URL holds connections of that loop: each asyncio.run that used the
    API without connection= (and never called aclose) must not leave a client and a socket behind."""
    server = RedisServer(tmp_path).start()  # its own: no other test's connections in the count
    try:
        monkeypatch.setenv("REDIS_URL", server.url)
        run_id = sync_enqueue_run("pool_agents:support", "many loops", connection=server.url)

        async def one_request() -> str:
            return (await aio.get_run(run_id)).status

        statuses = [run_loop(one_request()) for _ in range(20)]
        assert set(statuses) == {"queued"}
        with Redis.from_url(server.url) as counting:
            deadline = time.monotonic() + 10
            while (connected := counting.info("clients")["connected_clients"]) > 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert connected <= 2, f"{connected} connections: the loops' clients were left open"  # this one, the URL's
    finally:
        server.stop()


def test_aclose_closes_only_this_loops_clients(redis_server):
    """Two event loops (an app's, a test's) each using a decode_responses=True client: one's aclose
    closes its own, and neither raises for the other's nor stops it."""
    run_id = sync_enqueue_run("pool_agents:support", "two loops", connection=redis_server.url)
    ready, closed = threading.Event(), threading.Event()

    async def other_loop() -> str:
        a = _client(redis_server, decode_responses=True)
        await aio.get_run(run_id, connection=a)
        ready.set()
        await asyncio.to_thread(closed.wait, 60)
        status = (await aio.get_run(run_id, connection=a)).status  # its twin still its own
        await a.aclose()
        await aio.aclose()
        return status

    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(other_loop())))
    thread.start()
    try:
        assert ready.wait(60)

        async def this_loop() -> None:
            b = _client(redis_server, decode_responses=True)
            await aio.get_run(run_id, connection=b)
            await aio.aclose()  # this loop's twin, not the other loop's
            await b.aclose()

        run_loop(this_loop())
    finally:
        closed.set()
        thread.join(60)
    assert result == ["queued"]


def test_an_unreachable_redis_is_redis_unreachable_naming_the_server(monkeypatch):
    """As the sync API says it: RedisUnreachable naming the server, from wait_for_run as from get_run,
    and for a Sentinel client its sentinels and primary's name, not the bridge's class."""
    port = free_port()  # nothing listens there

    async def app() -> None:
        a = aredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        for call in (aio.get_run, aio.wait_for_run):
            with pytest.raises(RedisUnreachable, match=f"Redis unreachable at redis://127.0.0.1:{port}/0: "):
                await call("r_nowhere", connection=a)
        s = Sentinel([("127.0.0.1", port)], socket_timeout=1).master_for(MASTER)
        for call in (aio.get_run, aio.wait_for_run):
            with pytest.raises(RedisUnreachable, match=f"at redis\\+sentinel://127.0.0.1:{port}/{MASTER}/0: "):
                await call("r_nowhere", connection=s)

    run_loop(app())
