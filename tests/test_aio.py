"""agentpool.aio: the app-facing API as coroutines on a redis.asyncio client, against the test's real
Redis and real worker processes. Each test runs its app code in one event loop (asyncio.run)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from agentpool import RunExists, RunNotFound, aio
from agentpool import get_run as sync_get_run
from agentpool import list_runs as sync_list_runs

from conftest import assert_valid_conversation, run_loop, script_task

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
