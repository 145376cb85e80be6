"""The Redis connection a forking worker hands down to its work horses, one horse after the other.

redis-py makes a forked child open connections of its own (``ConnectionPool._checkpid`` drops what the
pool had in the parent), so each horse opened one per turn: a TCP handshake, the ``HELLO``, a close, and
on Redis's side about 130 µs of CPU and four or five reads a turn (docs/internals.md). Instead the worker
keeps one connection that it never sends a command on itself. Each horse takes it as its pool's first
connection; a horse that ends with it idle in its pool, on the socket it was handed and with nothing
unread, says so through its counts pipe (``agentpool.worker.forking``), and the next horse gets it. A horse
that does not say so (killed, timed out, the connection broken, reopened or still held by a thread)
leaves the worker to close its copy and open another before the next fork: a socket two processes may
have written to at once is never used again.

Only for plain ``redis://`` and ``unix://`` pools of redis-py's own ``ConnectionPool``: a TLS session's
state lives in the process that used it last (the worker's copy would be stale), a Sentinel pool's
primary can move between two horses, and another pool class keeps its connections where this module
does not look. Those open a connection per horse, as before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from redis import Redis
from redis.connection import Connection, ConnectionPool, UnixDomainSocketConnection
from redis.exceptions import RedisError

log = logging.getLogger("agentpool.worker")


def _supported(pool: Any) -> bool:
    return (
        type(pool) is ConnectionPool
        and pool.connection_class in (Connection, UnixDomainSocketConnection)
        and all(hasattr(pool, name) for name in ("_available_connections", "_created_connections", "_lock"))
    )


class HandDown:
    """One connection of ``client``'s pool, handed from the worker to each of its horses in turn, named
    ``name`` in Redis (``CLIENT LIST``: the connection a worker's horses share, sent with the handshake)."""

    def __init__(self, client: Redis, name: str) -> None:
        self.pool = client.connection_pool
        self.name = "-".join(name.split())  # Redis refuses a client name with spaces
        self.enabled = _supported(self.pool)
        self.connection: Any = None
        self._socket: Any = None  # in a horse: the socket it was handed

    # -- in the worker ----------------------------------------------------------------------------

    def before_fork(self) -> None:
        """Have a connection open for the horse forked next (the first one, or after a horse kept it)."""
        if not self.enabled or self.connection is not None:
            return
        connection = self.pool.make_connection()
        connection.client_name = self.name
        try:
            connection.connect()
        except (RedisError, OSError) as exc:
            # The horse opens its own, as it would without this; the worker tries again next fork.
            log.debug("no connection to hand down to the next work horse: %s", exc)
            self._forget(connection)
            return
        self.connection = connection

    def after_horse(self, report: Any) -> None:
        """The horse ended: keep the connection if it said it left it clean (``report``), else close it."""
        connection = self.connection
        if connection is None:
            return
        if isinstance(report, dict) and isinstance(report.get("health"), (int, float)):
            # The horse's reads advanced its health-check clock; the worker's copy has the fork's.
            connection.next_health_check = report["health"]
            return
        self.connection = None
        self._forget(connection)

    def close(self) -> None:
        if self.connection is not None:
            self._forget(self.connection)
            self.connection = None

    def _forget(self, connection: Any) -> None:
        try:
            connection.disconnect()
        except Exception as exc:  # noqa: BLE001 - a socket already gone is what is being closed
            log.debug("closing the connection a work horse left: %s", exc)
        with self.pool._lock:
            self.pool._created_connections = max(0, self.pool._created_connections - 1)

    # -- in a horse -------------------------------------------------------------------------------

    def take_in_horse(self) -> None:
        """Right after the fork, before any command: the handed connection becomes the pool's first."""
        connection = self.connection
        if connection is None:
            return
        pool = self.pool
        pool._checkpid()  # the reset a fork calls for, now: the worker's other connections are not ours
        connection.pid = os.getpid()
        with pool._lock:
            pool._available_connections.append(connection)
            pool._created_connections += 1
        self._socket = connection._sock

    def give_back_from_horse(self) -> dict[str, float] | None:
        """As the horse ends: take the connection out of the pool (no thread of this horse can use it
        again) and say whether the worker may hand it to the next horse: idle, on the socket it was
        handed, with nothing unread. None: it may not."""
        connection = self.connection
        if connection is None or self._socket is None:
            return None
        pool = self.pool
        with pool._lock:
            if connection not in pool._available_connections:
                return None  # a thread holds it, mid-command perhaps
            pool._available_connections.remove(connection)
            pool._created_connections -= 1
        if connection._sock is not self._socket:
            return None  # reopened (a broken connection): the worker's copy is of a closed socket
        try:
            if connection.can_read():
                return None  # a reply nobody read: not at a boundary
        except (RedisError, OSError):
            return None
        return {"health": float(connection.next_health_check)}
