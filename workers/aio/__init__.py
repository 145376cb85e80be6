"""``agentpool.aio``: the app-facing API for asyncio apps, on a ``redis.asyncio`` client.

The same calls as ``agentpool`` (``enqueue_run``, ``get_run``, ``wait_for_run``, ``cancel_run``,
``approve``, ``resume``, ``send_message``, ``fork_run``, ``watch``), with the same arguments, results
and errors, as coroutines (``watch`` as an async iterator). ``connection=`` takes a
``redis.asyncio.Redis``; without it, one is made from ``REDIS_URL`` (one per event loop).

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
from agentpool.runtime import connections, sentinel
from agentpool.runtime.settings import Settings, check_redis_url

__all__ = [
    "aclose",
    "approve",
    "cancel_run",
    "connect",
    "enqueue_run",
    "fork_run",
    "get_run",
    "resume",
    "send_message",
    "wait_for_run",
    "watch",
]

_default: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aredis.Redis] = weakref.WeakKeyDictionary()
_bytes_clients: weakref.WeakKeyDictionary[Any, aredis.Redis] = weakref.WeakKeyDictionary()


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
    made = [_default.pop(asyncio.get_running_loop(), None), *_bytes_clients.values()]
    _bytes_clients.clear()
    for made_client in made:
        if made_client is not None:
            await made_client.aclose(close_connection_pool=True)  # a twin was given its pool: close it too


def _green(connection: aredis.Redis | None) -> GreenRedis:
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


async def enqueue_run(agent: str, task: str, *, connection: aredis.Redis | None = None, **options: Any) -> str:
    """``agentpool.enqueue_run``'s options (``max_turns``, ``max_total_tokens``, ``max_cost_usd``, ``run_id``,
    ``check_agent``, ``queue``, ``webhook``, ``webhook_events``...). Loading the agent to check it imports its module in the loop's thread: an app
    that has the agent's code imports it at start-up, one that has not passes ``check_agent=False``."""
    return await run_sync(client.enqueue_run, agent, task, connection=_green(connection), **options)


async def get_run(run_id: str, *, connection: aredis.Redis | None = None, window: bool = False) -> Run:
    return await run_sync(client.get_run, run_id, connection=_green(connection), window=window)


async def cancel_run(
    run_id: str, *, connection: aredis.Redis | None = None, reason: str = "cancelled by request"
) -> str:
    return await run_sync(client.cancel_run, run_id, connection=_green(connection), reason=reason)


async def approve(
    run_id: str, tool_use_id: str | None = None, *, connection: aredis.Redis | None = None, **decision: Any
) -> list[str]:
    """``agentpool.approve``: ``approved`` (default True) and ``reason``."""
    return await run_sync(client.approve, run_id, tool_use_id, connection=_green(connection), **decision)


async def resume(run_id: str, *, connection: aredis.Redis | None = None, **amounts: Any) -> Run:
    """``agentpool.resume``: ``add_turns``, ``add_tokens``, ``add_usd``."""
    return await run_sync(client.resume, run_id, connection=_green(connection), **amounts)


async def send_message(run_id: str, content: Any, *, connection: aredis.Redis | None = None, **options: Any) -> str:
    """``agentpool.send_message``."""
    return await run_sync(conversation.send_message, run_id, content, connection=_green(connection), **options)


async def fork_run(run_id: str, *, connection: aredis.Redis | None = None, **options: Any) -> str:
    """``agentpool.fork_run``: ``at_turn``, ``fork_id``."""
    return await run_sync(conversation.fork_run, run_id, connection=_green(connection), **options)


async def wait_for_run(
    run_id: str,
    *,
    timeout: float = 300.0,
    connection: aredis.Redis | None = None,
    poll: float = 0.2,
    after_message: str | None = None,
) -> Run:
    """``agentpool.wait_for_run``, pausing with ``asyncio.sleep`` between reads."""
    r = _green(connection)
    await run_sync(client.check_waitable, r, run_id, after_message)
    deadline = time.monotonic() + timeout
    while (state := await run_sync(client.waited_for, r, run_id, after_message)) is not None:
        if time.monotonic() >= deadline:
            raise client.timed_out(state, after_message, timeout)
        await asyncio.sleep(poll)
    return await run_sync(client.get_run, run_id, connection=r)


async def watch(
    run_id: str, *, connection: aredis.Redis | None = None, **options: Any
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
