"""``agentpool.aio``: the app-facing API for asyncio apps, on a ``redis.asyncio`` client.

The same calls as ``agentpool`` (``enqueue_run``, ``get_run``, ``wait_for_run``, ``cancel_run``,
``approve``, ``resume``, ``send_message``, ``fork_run``, ``watch``), with the same arguments, results
and errors, as coroutines (``watch`` as an async iterator). ``connection=`` takes a
``redis.asyncio.Redis``, or ``agentpool.Shards`` of them for a sharded pool; without it, one is made from
``REDIS_URL`` (one per event loop), or one per shard from ``AGENTPOOL_SHARDS`` when that is set.

They run the sync API's own code (``agentpool.aio.bridge``): every Redis command is awaited on the
running loop, nothing blocks it, and no thread is used. Sentinel URLs need a client of your own
(``redis.asyncio.sentinel.Sentinel(...).master_for(...)``) passed as ``connection``.

The clients ``agentpool.aio`` makes by itself belong to one event loop (a redis.asyncio connection
does): they are closed by ``aclose()`` in that loop, or when the loop ends (``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError, TimeoutError

from agentpool import client, conversation, watching
from agentpool.aio.bridge import GreenRedis, run_sync
from agentpool.client import Run
from agentpool.runtime import connections, sentinel, shards
from agentpool.runtime.settings import RedisCredentialsRefused, Settings, check_redis_url, names_the_server
from agentpool.store.errors import AgentPoolError, RedisUnreachable

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


class _Made:
    """What ``agentpool.aio`` made by itself in one event loop: ``REDIS_URL``'s client, ``AGENTPOOL_SHARDS``'s,
    the bytes twin of each ``decode_responses=True`` client and the green view of each ``Shards`` an app
    passes. Their connections belong to that loop, so they are closed with it: by ``aclose()``, or by a
    keeper task when the loop ends (``asyncio.run`` cancels the tasks still pending before it closes the
    loop). Kept by loop in a plain dict, from which the keeper removes them: a WeakKeyDictionary keyed by
    the loop never lets go, since the clients' connections hold the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.client: aredis.Redis | None = None
        self.shards: shards.Shards | None = None
        self.twins: weakref.WeakKeyDictionary[Any, aredis.Redis] = weakref.WeakKeyDictionary()  # app's pool -> twin
        self.green_shards: weakref.WeakKeyDictionary[shards.Shards, shards.Shards] = weakref.WeakKeyDictionary()
        self.keeper = loop.create_task(self._close_at_loop_end(loop), name="agentpool.aio closes its clients")

    async def _close_at_loop_end(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            await loop.create_future()  # never done: cancelled when the loop ends
        finally:
            if _made.get(loop) is self:  # not closed by aclose() already
                del _made[loop]
                await self.close()

    async def close(self) -> None:
        """Close every client made, each even if closing another one failed (the first failure is raised
        after)."""
        made = [self.client, *self.twins.values()]
        made += [green._target for green in self.shards.members] if self.shards else []  # type: ignore[union-attr]
        failed: Exception | None = None
        for made_client in made:
            if made_client is None:
                continue
            try:
                await made_client.aclose(close_connection_pool=True)  # a twin was given its pool: close it too
            except Exception as exc:  # noqa: BLE001 - raised below, once the others are closed
                failed = failed or exc
        if failed is not None:
            raise failed


_made: dict[asyncio.AbstractEventLoop, _Made] = {}


def _made_here() -> _Made:
    loop = asyncio.get_running_loop()
    made = _made.get(loop)
    if made is None:
        made = _made[loop] = _Made(loop)
    return made


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
    """Close the clients ``agentpool.aio`` made by itself in this event loop: its client from ``REDIS_URL``
    (used when no ``connection`` is given), or ``AGENTPOOL_SHARDS``'s, and the bytes twin it keeps beside
    a ``decode_responses=True`` client. An app calls it at shutdown, where it closes its own client (a
    FastAPI lifespan, say); a loop that ends (``asyncio.run``) has them closed anyway. Other loops' clients
    are theirs: a redis.asyncio connection cannot be closed from another loop."""
    made = _made.pop(asyncio.get_running_loop(), None)
    if made is not None:
        made.keeper.cancel()
        await made.close()


def _green(connection: aredis.Redis | shards.Shards | None) -> GreenRedis | shards.Shards:
    if isinstance(connection, shards.Shards):
        return _green_pool(connection)
    if connection is None and shards.env_urls():
        made = _made_here()
        if made.shards is None:
            made.shards = shards.Shards([GreenRedis(connect(u)) for u in shards.env_urls()], origin=shards.ENV)
        return made.shards
    if connection is None:
        made = _made_here()
        if made.client is None:
            made.client = connect()
        connection = made.client
    elif not isinstance(connection, aredis.Redis):
        raise TypeError(
            f"agentpool.aio takes a redis.asyncio client as connection, got {type(connection).__name__} "
            "(the sync API, agentpool, takes a redis.Redis)"
        )
    pool = connection.connection_pool
    if pool.connection_kwargs.get("decode_responses"):  # agentpool reads bytes (msgpack records, RQ)
        made = _made_here()
        twin = made.twins.get(pool)
        if twin is None:
            twin = made.twins[pool] = _bytes_twin(connection)
        connection = twin
    return GreenRedis(connection)


def _bytes_twin(app_client: aredis.Redis) -> aredis.Redis:
    """A bytes client with ``app_client``'s connection settings and limits, on a pool of its own: what
    ``connections.derive`` builds for the sync API, for a ``redis.asyncio`` client."""
    pool = app_client.connection_pool
    kwargs = {**pool.connection_kwargs, "decode_responses": False}
    kwargs.pop("connection_pool", None)  # a Sentinel pool's reference to itself: the new pool makes its own
    limits = {"connection_class": pool.connection_class, "max_connections": pool.max_connections}
    if isinstance(pool, SentinelConnectionPool):  # the same primary, found through the same sentinels
        twin = SentinelConnectionPool(
            pool.service_name,
            pool.sentinel_manager,
            is_master=pool.is_master,
            check_connection=pool.check_connection,
            **limits,
            **kwargs,
        )
    elif isinstance(pool, aredis.BlockingConnectionPool):  # callers wait as long for a connection as the app's
        twin = aredis.BlockingConnectionPool(timeout=pool.timeout, **limits, **kwargs)
    else:
        try:
            twin = type(pool)(**limits, **kwargs)
        except TypeError:
            raise AgentPoolError(
                f"agentpool reads Redis as bytes, as RQ does, and cannot derive a bytes client from this "
                f"decode_responses=True client ({type(pool).__name__}); pass one made without decode_responses=True"
            ) from None
    return aredis.Redis(connection_pool=twin)


def _green_pool(pool: shards.Shards) -> shards.Shards:
    """The Shards an app passes, its members seen as sync clients (the first time in a loop, checked and
    kept, with the twins it holds)."""
    made = _made_here()
    green = made.green_shards.get(pool)
    if green is None:
        for i, member in enumerate(pool.members):
            if not isinstance(member, aredis.Redis):
                raise TypeError(
                    f"agentpool.aio takes Shards of redis.asyncio clients; shard {i} is a {type(member).__name__} "
                    "(make them with agentpool.aio.connect(url), or set AGENTPOOL_SHARDS)"
                )
        green = made.green_shards[pool] = shards.Shards([_green(m) for m in pool.members], origin=pool.origin)
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


async def list_runs(
    *, connection: aredis.Redis | shards.Shards | None = None, limit: int = 100, **filters: Any
) -> list[Run]:
    """``agentpool.list_runs``: ``limit``, ``status``, ``agent``; on a sharded pool every shard's, merged."""
    green = _green(connection)
    if not isinstance(green, shards.Shards):
        return await run_sync(client.list_runs, connection=green, limit=limit, **filters)
    # The sync list_runs reads the shards in threads (shards.on_every_shard), where a bridged client
    # cannot be used: here each shard's list is a bridged read of its own, all awaited at once, and
    # the answers are taken as shards.each_answering takes them.
    outcomes = await asyncio.gather(
        *(run_sync(client.list_runs, connection=member, limit=limit, **filters) for member in green.clients),
        return_exceptions=True,
    )
    pages: list[list[Run]] = []
    silent: list[str] = []
    refused: list[RedisCredentialsRefused] = []
    for shard, outcome in enumerate(outcomes):
        if isinstance(outcome, RedisCredentialsRefused):
            refused.append(outcome)  # a wrong password is not a silent shard: raised as it is, as the sync list does
        elif isinstance(outcome, (ConnectionError, TimeoutError)):
            cause = outcome.__cause__ or outcome  # the shard's name says where, as the sync list says it
            silent.append(f"{green.name(shard)}: {str(cause).strip() or type(cause).__name__}")
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            pages.append(outcome)
    if refused:
        raise refused[0]
    if silent:  # all of the runs or an error, as the sync list_runs
        raise RedisUnreachable(f"Redis unreachable at {silent[0]}")
    return client.newest_first(pages, limit)


async def run_tree(
    run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any
) -> dict[str, Any]:
    """``agentpool.run_tree``: the run and its child runs, recursively (``depth_limit``)."""
    return await run_sync(client.run_tree, run_id, connection=_green(connection), **options)


async def cancel_run(run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any) -> str:
    """``agentpool.cancel_run``: ``reason``, ``by``."""
    return await run_sync(client.cancel_run, run_id, connection=_green(connection), **options)


async def approve(
    run_id: str,
    tool_use_id: str | None = None,
    *,
    connection: aredis.Redis | shards.Shards | None = None,
    **decision: Any,
) -> list[str]:
    """``agentpool.approve``: ``approved`` (default True), ``reason`` and ``by``."""
    return await run_sync(client.approve, run_id, tool_use_id, connection=_green(connection), **decision)


async def resume(run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **amounts: Any) -> Run:
    """``agentpool.resume``: ``add_turns``, ``add_tokens``, ``add_usd``, ``by``."""
    return await run_sync(client.resume, run_id, connection=_green(connection), **amounts)


async def send_message(
    run_id: str, content: Any, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any
) -> str:
    """``agentpool.send_message``: ``message_id``, ``by``."""
    return await run_sync(conversation.send_message, run_id, content, connection=_green(connection), **options)


async def fork_run(run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any) -> str:
    """``agentpool.fork_run``: ``at_turn``, ``fork_id``, ``by``."""
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
    client.check_wait_times(timeout, poll)
    try:
        r = await run_sync(shards.route, _green(connection), run_id)  # the run's shard on a sharded pool
        await run_sync(client.check_waitable, r, run_id, after_message)
        deadline = time.monotonic() + timeout
        while (state := await run_sync(client.waited_for, r, run_id, after_message)) is not None:
            if time.monotonic() >= deadline:
                raise client.timed_out(state, after_message, timeout, await run_sync(client.why_still, r, state))
            await asyncio.sleep(poll)
        return await run_sync(client.get_run, run_id, connection=r)
    except (ConnectionError, TimeoutError) as exc:  # the sync call names the server as a whole, not its pieces
        _raise_as_the_sync_api(exc, connection=connection)


@names_the_server
def _raise_as_the_sync_api(exc: BaseException, *, connection: Any) -> NoReturn:
    """Raises ``exc`` as the sync API's calls raise it (``names_the_server``): a Redis that cannot be
    reached is a ``RedisUnreachable`` naming ``connection``'s server."""
    raise exc


async def watch(
    run_id: str, *, connection: aredis.Redis | shards.Shards | None = None, **options: Any
) -> AsyncIterator[dict[str, Any]]:
    """``agentpool.watch`` as an async iterator: ``since_start``, ``after``, ``live_output``, ``block_ms``. Its
    blocking reads are awaited on the loop."""
    items = await run_sync(watching.watch, run_id, connection=_green(connection), **options)
    end = object()
    try:
        while (item := await run_sync(next, items, end)) is not end:
            yield item  # type: ignore[misc]
    finally:
        await run_sync(items.close)
