"""``agentpool.aio``: the app-facing API for asyncio apps, on a ``redis.asyncio`` client.

The same calls as ``agentpool`` (``enqueue_run``, ``get_run``, ``wait_for_run``, ``cancel_run``,
``approve``, ``resume``, ``send_message``, ``fork_run``, ``watch``), with the same arguments, results
and errors, as coroutines (``watch`` as an async iterator). ``connection=`` takes a
``redis.asyncio.Redis``, or ``agentpool.Shards`` of them for a sharded pool; without it, one is made from
``REDIS_URL`` (one per event loop), or one per shard from ``AGENTPOOL_SHARDS`` when that is set.

They run the sync API's own code (``agentpool.aio.bridge``): every Redis command is awaited on the
running loop, nothing blocks it, and no thread is used. Sentinel URLs need a client of your own
(``redis.asyncio.sentinel.Sentinel(...).master_for(...)``) passed as ``connection``.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.retry import Retry

from agentpool import client, conversation, watching
from agentpool.aio.bridge import GreenRedis, run_sync
from agentpool.client import Run
from agentpool.runtime import connections, sentinel, shards
from agentpool.runtime.settings import Settings, check_redis_url

__all__ = [
    "aclose",
    "approve",
    "cancel_run",
    "connect",
    "enqueue_run",
    "fork_run",
    "get_run",
    "list_runs",
    "resume",
    "run_tree",
    "send_message",
    "wait_for_run",
    "watch",
]

_default: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aredis.Redis] = weakref.WeakKeyDictionary()
_bytes_clients: weakref.WeakKeyDictionary[Any, aredis.Redis] = weakref.WeakKeyDictionary()
# AGENTPOOL_SHARDS's clients (one Shards per event loop), and the green twin of each Shards an app passes.
_default_shards: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, shards.Shards] = weakref.WeakKeyDictionary()
_green_shards: weakref.WeakKeyDictionary[shards.Shards, shards.Shards] = weakref.WeakKeyDictionary()


def connect(url: str | None = None) -> aredis.Redis:
    """A ``redis.asyncio`` client for ``url`` (default ``REDIS_URL``), with the sync API's retry and
    the options that find out a silent peer (``agentpool.runtime.connections``)."""
    url = check_redis_url(url or Settings.from_env().redis_url, subject="REDIS_URL" if url is None else "the Redis URL")
    if sentinel.is_sentinel(url):
        raise ValueError(
            "agentpool.aio does not build Sentinel clients: pass connection=redis.asyncio.sentinel."
            "Sentinel(...).master_for(name)"
        )
    return aredis.Redis.from_url(url, **{**connections.silence_options(), "retry": connections.ride_out(Retry)})


async def aclose() -> None:
    """Close the clients ``agentpool.aio`` made by itself: this loop's client from ``REDIS_URL`` (used when
    no ``connection`` is given) and the bytes twin it keeps beside a ``decode_responses=True`` client. An
    app calls it at shutdown, where it closes its own client (a FastAPI lifespan, say)."""
    loop = asyncio.get_running_loop()
    sharded = _default_shards.pop(loop, None)
    made = [_default.pop(loop, None), *_bytes_clients.values()]
    made += [green._target for green in sharded.members] if sharded else []  # type: ignore[union-attr]
    _bytes_clients.clear()
    for made_client in made:
        if made_client is not None:
            await made_client.aclose(close_connection_pool=True)  # a twin was given its pool: close it too


def _green(connection: aredis.Redis | shards.Shards | None) -> GreenRedis | shards.Shards:
    if isinstance(connection, shards.Shards):
        return _green_pool(connection)
    if connection is None and shards.env_urls():
        loop = asyncio.get_running_loop()
        pool = _default_shards.get(loop)
        if pool is None:
            urls = shards.env_urls()
            pool = _default_shards[loop] = shards.Shards([GreenRedis(connect(u)) for u in urls], origin=shards.ENV)
        return pool
    if connection is None:
        loop = asyncio.get_running_loop()
        connection = _default.get(loop)
        if connection is None:
            connection = _default[loop] = connect()
    elif not isinstance(connection, aredis.Redis):
        raise TypeError(
            f"agentpool.aio takes a redis.asyncio client as connection, got {type(connection).__name__} "
            "(the sync API, agentpool, takes a redis.Redis)"
        )
    pool = connection.connection_pool
    if pool.connection_kwargs.get("decode_responses"):  # agentpool reads bytes (msgpack records, RQ)
        plain = _bytes_clients.get(pool)
        if plain is None:
            kwargs = {**pool.connection_kwargs, "decode_responses": False}
            plain = _bytes_clients[pool] = aredis.Redis(
                connection_pool=type(pool)(connection_class=pool.connection_class, **kwargs)
            )
        connection = plain
    return GreenRedis(connection)


def _green_pool(pool: shards.Shards) -> shards.Shards:
    """The Shards an app passes, its members seen as sync clients (the first time, checked and kept)."""
    green = _green_shards.get(pool)
    if green is None:
        for i, member in enumerate(pool.members):
            if not isinstance(member, aredis.Redis):
                raise TypeError(
                    f"agentpool.aio takes Shards of redis.asyncio clients; shard {i} is a {type(member).__name__} "
                    "(make them with agentpool.aio.connect(url), or set AGENTPOOL_SHARDS)"
                )
        green = _green_shards[pool] = shards.Shards([_green(m) for m in pool.members], origin=pool.origin)
    return green


async def enqueue_run(
    agent: str, task: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any
) -> str:
    """``agentpool.enqueue_run``'s options (``max_turns``, ``max_total_tokens``, ``max_cost_usd``, ``run_id``,
    ``check_agent``, ``queue``, ``webhook``, ``webhook_events``...). Loading the agent to check it imports its module in the loop's thread: an app
    that has the agent's code imports it at start-up, one that has not passes ``check_agent=False``."""
    return await run_sync(client.enqueue_run, agent, task, connection=_green(connection), **options)


async def get_run(run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, window: bool = False) -> Run:
    return await run_sync(client.get_run, run_id, connection=_green(connection), window=window)


async def list_runs(*, connection: aredis.Redis | shards.Shards | None = None, **options: Any) -> list[Run]:
    """``agentpool.list_runs``: ``limit``, ``status``, ``agent``; on a sharded pool every shard's, merged."""
    return await run_sync(client.list_runs, connection=_green(connection), **options)


async def run_tree(
    run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any
) -> dict[str, Any]:
    """``agentpool.run_tree``: the run and its child runs, recursively (``depth_limit``)."""
    return await run_sync(client.run_tree, run_id, connection=_green(connection), **options)


async def cancel_run(
    run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, reason: str = "cancelled by request"
) -> str:
    return await run_sync(client.cancel_run, run_id, connection=_green(connection), reason=reason)


async def approve(
    run_id: str,
    tool_use_id: str | None = None,
    *,
    connection: aredis.Redis | shards.Shards | None = None,
    **decision: Any,
) -> list[str]:
    """``agentpool.approve``: ``approved`` (default True) and ``reason``."""
    return await run_sync(client.approve, run_id, tool_use_id, connection=_green(connection), **decision)


async def resume(run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **amounts: Any) -> Run:
    """``agentpool.resume``: ``add_turns``, ``add_tokens``, ``add_usd``."""
    return await run_sync(client.resume, run_id, connection=_green(connection), **amounts)


async def send_message(
    run_id: str, content: Any, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any
) -> str:
    """``agentpool.send_message``."""
    return await run_sync(conversation.send_message, run_id, content, connection=_green(connection), **options)


async def fork_run(run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any) -> str:
    """``agentpool.fork_run``: ``at_turn``, ``fork_id``."""
    return await run_sync(conversation.fork_run, run_id, connection=_green(connection), **options)


async def wait_for_run(
    run_id: str,
    *,
    timeout: float = 300.0,
    connection: aredis.Redis | shards.Shards | None = None,
    poll: float = 0.2,
    after_message: str | None = None,
) -> Run:
    """``agentpool.wait_for_run``, pausing with ``asyncio.sleep`` between reads."""
    r = await run_sync(shards.route, _green(connection), run_id)  # the run's shard on a sharded pool
    await run_sync(client.check_waitable, r, run_id, after_message)
    deadline = time.monotonic() + timeout
    while (state := await run_sync(client.waited_for, r, run_id, after_message)) is not None:
        if time.monotonic() >= deadline:
            raise client.timed_out(state, after_message, timeout)
        await asyncio.sleep(poll)
    return await run_sync(client.get_run, run_id, connection=r)


async def watch(
    run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any
) -> AsyncIterator[dict[str, Any]]:
    """``agentpool.watch`` as an async iterator: ``since_start``, ``live_output``, ``block_ms``. Its
    blocking reads are awaited on the loop."""
    items = await run_sync(watching.watch, run_id, connection=_green(connection), **options)
    end = object()
    try:
        while (item := await run_sync(next, items, end)) is not end:
            yield item  # type: ignore[misc]
    finally:
        await run_sync(items.close)
