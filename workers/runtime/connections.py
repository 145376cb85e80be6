"""Every Redis client agentpool builds is built here, so that every connection finds out a silent peer.

A peer that stops answering without closing the connection (a dropped NAT or conntrack entry, a load
balancer failover, a live-migrated VM: no FIN, no RST) leaves a read waiting until something gives up
on it. redis-py 8 gives up after ``socket_timeout`` (5 s by default), but RQ's worker raises its
connection pool's socket timeout to its dequeue timeout + 10 s (``BaseWorker._set_connection``: 415 s
at RQ's defaults, so that its 405 s ``BLMOVE`` is not cut short), and the worker's turns, heartbeats,
lease keeper and reaper share that pool: one swallowed reply wedged a worker for seven minutes. So:

- **socket timeout** (``AGENTPOOL_REDIS_TIMEOUT``, 5 s; at least ``BLOCK_LIMIT`` + 1 s and twice
  ``AGENTPOOL_REPLICA_ACK_TIMEOUT`` + 1 s, since the durability guard's ``WAIT`` and ``WAITAOF`` block
  for up to that each): a command with no answer in that long has its connection closed, and the
  clients that retry (workers, reaper, supervisor, the CLI's one quick retry) re-send it on a new one.
  Every blocking command agentpool sends blocks for at most ``BLOCK_LIMIT``: the workers' dequeue
  (``DEQUEUE_BLOCK``: our workers override RQ's 405 s), the dashboard's and watchers' ``XREAD BLOCK``.
- **TCP keepalive** (first probe after 5 s idle, then 3 probes 2 s apart): the kernel drops a
  connection whose peer is gone within ~11 s even while nothing is asked on it.
- **health checks** (every 10 s): a pooled connection idle that long is PINGed before it is used. A
  connection opened this instant is not (``handshake``): redis-py's own handshake would PING it first,
  a round trip on every new connection (a forking worker's horses share one their worker opens,
  ``agentpool.worker.handdown``, and open their own when it cannot be handed on).

The bound: a command sent on a connection that went silent is re-sent on a new connection after
``socket_timeout``. A lease renewal is sent a third of the TTL after the last one, so at the default
TTL (15 s) a silent renewal re-sent after 5 s still lands in time; with a TTL under three socket
timeouts one may cost the lease (the run is then taken over: fenced, nothing lost). Re-sending is safe: every agentpool write is
recognised when delivered twice (write ids, ``store/writes.py``; RQ's own bookkeeping is idempotent or
counts only), which ``tests/test_delivered_twice.py`` and ``tests/test_silent_connections.py`` prove.
"""

from __future__ import annotations

import socket
from typing import Any

from redis import BlockingConnectionPool, Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, ConnectionError, TimeoutError
from redis.retry import Retry

from agentpool.runtime import sentinel

BLOCK_LIMIT = 2.0  # seconds: the longest any blocking command agentpool sends may block
DEQUEUE_BLOCK = 2  # seconds a worker's BLMOVE waits for a turn (RQ's default is 405)
HEALTH_CHECK_INTERVAL = 10  # seconds a pooled connection may sit idle before it is PINGed on reuse
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES = 5, 2, 3


def worth_retrying(error: Exception) -> bool:
    """A dropped or silent connection is retried; credentials refused are not. redis-py's
    ``AuthenticationError`` is a ``ConnectionError``, so without this a wrong password was retried like
    a Redis restart (12 times, 17 s) and then reported as "unreachable": no retry changes a password."""
    return not isinstance(error, AuthenticationError)


def ride_out(retry_class: type[Any] = Retry) -> Any:
    """A worker's policy: ~15 s of retries, enough to ride out a Redis restart or a failover
    (``retry_class``: redis.asyncio's ``Retry`` for an asyncio client)."""
    return retry_class(ExponentialBackoff(cap=2.0, base=0.05), retries=12, is_retryable=worth_retrying)


def quick(retries: int = 1) -> Retry:
    """An interactive command's: one quick retry (a re-send after a silent connection), no ride-out."""
    return Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=retries, is_retryable=worth_retrying)


def keepalive_options() -> dict[int, int]:
    """TCP keepalive tuned to find a dead peer in seconds, not the OS's 2 hours (the options that
    this platform has: macOS names TCP_KEEPIDLE TCP_KEEPALIVE)."""
    wanted = {
        "TCP_KEEPIDLE": KEEPALIVE_IDLE,
        "TCP_KEEPALIVE": KEEPALIVE_IDLE,
        "TCP_KEEPINTVL": KEEPALIVE_INTERVAL,
        "TCP_KEEPCNT": KEEPALIVE_PROBES,
    }
    options: dict[int, int] = {}
    for name, value in wanted.items():
        option = getattr(socket, name, None)
        if option is not None and option not in options:
            options[option] = value
    return options


def socket_timeout(configured: float | None = None) -> float:
    """The socket timeout every client gets: ``configured`` (default ``AGENTPOOL_REDIS_TIMEOUT``), raised
    if need be above the longest blocking command agentpool sends."""
    from agentpool.runtime.settings import Settings

    settings = Settings.from_env()
    configured = settings.redis_timeout if configured is None else configured
    return max(configured, BLOCK_LIMIT + 1.0, 2 * settings.replica_ack_timeout + 1.0)


def silence_options(timeout: float | None = None) -> dict[str, Any]:
    """The connection options that find out a silent peer (see the module docstring)."""
    seconds = socket_timeout(timeout)
    return {
        "socket_timeout": seconds,
        "socket_connect_timeout": min(seconds, 5.0),
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(),
        "health_check_interval": HEALTH_CHECK_INTERVAL,
        "retry_on_error": [ConnectionError, TimeoutError],
    }


def handshake(connection: Any) -> None:
    """A new connection's handshake (``HELLO``, ``AUTH``, ``SELECT``...) without the health check redis-py
    sends before it: a ``PING`` that can only find the socket just opened alive. The handshake's replies
    start the connection's health-check clock, as any reply does."""
    connection.on_connect_check_health(check_health=False)


def build(
    url: str, *, retry: Retry, max_connections: int | None = None, socket_timeout: float | None = None, **options: Any
) -> Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://`` or a Sentinel URL) with the silence
    options, ``retry`` and ``options`` (which win). ``max_connections`` makes a plain URL's pool a
    blocking one (callers wait up to 30 s for a free connection; redis-py's default pool fails the 101st
    at once); Sentinel has no blocking pool in redis-py, so there it is the pool's hard cap."""
    merged = {**silence_options(socket_timeout), "redis_connect_func": handshake, "retry": retry, **options}
    if url.lower().startswith("unix://"):
        merged.pop("socket_keepalive", None)  # TCP options mean nothing on a Unix socket
        merged.pop("socket_keepalive_options", None)
    if sentinel.is_sentinel(url):
        if max_connections is not None:
            merged["max_connections"] = max_connections
        return sentinel.client(sentinel.parse(url), **merged)
    if max_connections is None:
        return Redis.from_url(url, **merged)
    return Redis(
        connection_pool=BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30, **merged)
    )


def derive(r: Redis, **overrides: Any) -> Redis:
    """A client with a pool of its own and ``r``'s connection settings (and ``overrides``), following the
    same Sentinel primary if ``r`` does. Raises TypeError for a pool class it cannot rebuild."""
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in overrides and f"orig_{name}" in r.connection_pool.connection_kwargs:
            overrides[f"orig_{name}"] = overrides[name]  # what redis-py 8 restores after a maintenance event
    cloned = sentinel.clone(r, **overrides)
    if cloned is not None:
        return cloned
    pool = r.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides}
    if isinstance(pool, BlockingConnectionPool):
        return Redis(
            connection_pool=BlockingConnectionPool(
                connection_class=pool.connection_class,
                max_connections=pool.max_connections,
                timeout=pool.timeout,
                **kwargs,
            )
        )
    return Redis(
        connection_pool=type(pool)(
            connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
        )
    )
