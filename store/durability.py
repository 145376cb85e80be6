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
that has the probe has every write the primary made before it, whichever connection made them, which
includes the intent and save point A (both acknowledged to this worker before the guard runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ResponseError

from agentpool.store.errors import StoreError
from agentpool.store.keys import DURABILITY_PROBE

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


# Servers known to lack WAITAOF (Redis < 7.2), by "host:port" of the connection that asked.
_no_waitaof: set[str] = set()


def wait_durable(r: Redis, guard: Guard) -> None:
    """Return once the guard is satisfied; raise :class:`NotReplicated` if it is not in time."""
    if not guard.active:
        return
    use_aof = guard.waitaof != "off" and _server(r) not in _no_waitaof
    with r.pipeline(transaction=False) as pipe:
        pipe.incr(DURABILITY_PROBE)
        if guard.replicas:
            pipe.execute_command("WAIT", guard.replicas, guard.timeout_ms)
        if use_aof:
            numreplicas = guard.replicas if guard.waitaof == "replicas" else 0
            pipe.execute_command("WAITAOF", 1, numreplicas, guard.timeout_ms)
        replies = pipe.execute(raise_on_error=False)
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
