"""The durability guard: before a tool whose effect is not ``read`` runs, the writes it depends on (its
ledger intent, and save point A that recorded the call) must be acknowledged by replicas, or fsynced.

Replication is asynchronous: a failover can lose writes the primary acknowledged. A lost intent lets an
``unsafe`` call run twice; a lost save point A makes the retried model call answer with new tool_use
ids, so an ``idempotent`` call would run under a second key. So the tool waits for ``WAIT numreplicas
timeout`` (and ``WAITAOF`` where the server has it) first; if fewer acknowledgements than asked come in
time, :class:`NotReplicated` is raised and the tool does not run (the turn is handed back and retried).

The trap: ``WAIT`` waits only for the writes *of the connection it is sent on*; from a pooled connection
that wrote nothing it returns at once. So the guard sends one write of its own (``INCR`` of a probe key)
and ``WAIT`` together, in one pipeline, on one connection. The replication stream is ordered: a replica
that has the probe has every write the primary made before it, whichever connection made them.

The second trap: the server that acknowledges may not be the one the writes went to. The primary dies
with the guard in flight, the client re-sends, and an endpoint that follows the failover (a managed
primary endpoint, a virtual IP, a proxy in front of Sentinel) delivers it to the promoted replica,
which lacks the intent and save point A but has a replica of its own to acknowledge at once. So the
probe is a script (``store/lua/durability_probe.lua``) that writes only where the lease, the run's
turn and phase, and the call's intent exactly as written are (a :class:`Proof`), and the guard is sent
once: a connection lost during it is "not replicated", never a retry that may succeed elsewhere (or on
a primary restarted without the writes, where ``WAITAOF`` would fsync the probe alone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from agentpool.store.errors import StoreError
from agentpool.store.keys import DURABILITY_PROBE, RunKeys
from agentpool.store.scripts import compact_source

log = logging.getLogger("agentpool.durability")
WAITAOF_MODES = ("off", "local", "replicas")


class NotReplicated(StoreError):
    """Fewer replicas (or fsyncs) acknowledged a tool's intent than the guard asks for, in time."""

    retryable = True


@dataclass(frozen=True)
class Guard:
    replicas: int = 0  # WAIT for this many replicas (0: no WAIT)
    timeout_ms: int = 1000
    waitaof: str = "off"  # off | local (fsync on the primary) | replicas (and on the replicas asked for)

    @property
    def active(self) -> bool:
        return self.replicas > 0 or self.waitaof != "off"

    def describe(self) -> str:
        if not self.active:
            return "off: tools wait for no replica (a lone Redis)"
        parts = []
        if self.replicas:
            parts.append(f"WAIT for {self.replicas} replica(s)")
        if self.waitaof != "off":
            parts.append(f"WAITAOF ({self.waitaof})")
        return " and ".join(parts) + f", up to {self.timeout_ms} ms, before each tool whose effect is not read"


@dataclass(frozen=True)
class Proof:
    """The writes a guard protects, as the turn made them: ``token``'s lease on the run, the run at
    ``turns`` in ``phase`` (its save point A), and ``intent`` (the packed record) in ``field`` of the
    ledger. The probe is written, and so acknowledged, only on a server that holds all of them."""

    keys: RunKeys
    token: str
    turns: int
    phase: str
    field: str
    intent: bytes


PROBE_REFUSED = {
    -1: "the lease is not this turn's there",
    -2: "the run is not running there",
    -3: "the run is not at the turn's save point A there",
    -4: "the call's intent is not there",
}

# Servers known to lack WAITAOF (Redis < 7.2), by "host:port" of the connection that asked.
_no_waitaof: set[str] = set()


def wait_durable(r: Redis, guard: Guard, proof: Proof | None = None) -> None:
    """Return once the guard is satisfied; raise :class:`NotReplicated` if it is not in time, if the
    server that answers lacks the writes of ``proof``, or if the connection is lost meanwhile. Without a
    ``proof`` (telling whether a deployment has replicas) the probe is a plain ``INCR``."""
    if not guard.active:
        return
    use_aof = guard.waitaof != "off" and _server(r) not in _no_waitaof
    if proof is None:
        commands: list[tuple[Any, ...]] = [("INCR", DURABILITY_PROBE)]
    else:
        keys = proof.keys
        commands = [
            ("EVAL", compact_source("durability_probe"), 4, keys.lease, keys.run, keys.ledger, DURABILITY_PROBE)
            + (proof.token, proof.turns, proof.phase, proof.field, proof.intent)
        ]
    if guard.replicas:
        commands.append(("WAIT", guard.replicas, guard.timeout_ms))
    if use_aof:
        numreplicas = guard.replicas if guard.waitaof == "replicas" else 0
        commands.append(("WAITAOF", 1, numreplicas, guard.timeout_ms))
    replies = _send_once(r, commands)
    probe = replies[0]
    if isinstance(probe, ResponseError):
        raise NotReplicated(f"the guard's probe failed: {probe}")
    if proof is not None and int(probe) != 1:
        raise NotReplicated(
            f"the server that answered lacks what the call depends on: {PROBE_REFUSED.get(int(probe), probe)}"
        )
    acks = int(replies[1]) if guard.replicas else guard.replicas
    if guard.replicas and acks < guard.replicas:
        raise NotReplicated(
            f"{acks} of {guard.replicas} replica(s) acknowledged the call's intent within {guard.timeout_ms} ms"
        )
    if use_aof:
        reply = replies[-1]
        if isinstance(reply, ResponseError):
            if "unknown command" in str(reply).lower():
                _no_waitaof.add(_server(r))
                log.warning("this Redis has no WAITAOF (it came in 7.2): AGENTPOOL_WAITAOF is ignored for it")
                return
            raise NotReplicated(f"WAITAOF failed: {reply}")
        local, remote = (int(x) for x in reply)
        if local < 1 or (guard.waitaof == "replicas" and remote < guard.replicas):
            raise NotReplicated(
                f"the call's intent was fsynced locally {local}, on {remote} replica(s), within {guard.timeout_ms} ms"
            )


def _send_once(r: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """The replies to ``commands``, sent together on one connection and never re-sent: redis-py's retry
    would send them again after a lost connection, perhaps to another server than the first went to.
    A reply that is an error is returned, not raised; a lost connection is :class:`NotReplicated`."""
    pool = r.connection_pool
    try:
        conn = pool.get_connection()
    except (ConnectionError, TimeoutError) as exc:
        raise NotReplicated(f"Redis could not be reached for the guard ({type(exc).__name__})") from exc
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except (ConnectionError, TimeoutError, OSError) as exc:
        conn.disconnect()
        raise NotReplicated(
            f"the connection was lost during the guard ({type(exc).__name__}): whether the replicas have the "
            "call's intent is unknown"
        ) from exc
    finally:
        pool.release(conn)


def waitaof_supported(r: Redis) -> bool:
    """Asks once: WAITAOF 0 0 0 answers at once where the command exists."""
    try:
        r.execute_command("WAITAOF", 0, 0, 0)
    except ResponseError as exc:
        if "unknown command" in str(exc).lower():
            _no_waitaof.add(_server(r))
            return False
        raise
    return True


def _server(r: Redis) -> str:
    kwargs = r.connection_pool.connection_kwargs
    service = getattr(r.connection_pool, "service_name", None)
    return service or f"{kwargs.get('host')}:{kwargs.get('port')}"
