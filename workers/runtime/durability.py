"""Which durability guard applies (``agentpool.store.durability``), decided once per process.

``AGENTPOOL_REPLICA_ACKS=auto`` (the default) waits for one replica in a deployment that has them: a
client that goes through Sentinel, or a primary whose ``INFO replication`` reports connected replicas
or has had one (its replication backlog is active), or whose ``min-replicas-to-write`` is set; on a
lone Redis it waits for none. It is decided from the deployment, not from the replicas up at this
instant, except where ``INFO`` is refused (an ACL user without ``@dangerous``): then a replica that
acknowledges a probe write within ``REPLICA_PROBE_MS`` is what tells a deployment with replicas (on a
lone Redis, one tool call in ``RECHECK`` seconds pays that wait). Once it waits for one it never
stops: a replica that falls behind or disconnects later makes tools wait (and their turns be handed
back), never run unguarded. While it waits for none it looks
again every ``RECHECK`` seconds, so a replica added after the workers started is waited for.

A forking worker decides in the parent, before each fork (``before_fork``), at most once per
``RECHECK``: every work horse inherits that decision as if made when it was forked, so horses do not
each pay the decision again (with ``INFO`` refused that is a ``REPLICA_PROBE_MS`` wait per guarded turn).
"""

from __future__ import annotations

import logging
import os
import time

from redis import Redis
from redis.exceptions import RedisError, ResponseError
from redis.sentinel import SentinelConnectionPool

from agentpool.runtime.settings import Settings
from agentpool.store.durability import Guard, NotReplicated, wait_durable, waitaof_supported

log = logging.getLogger("agentpool.durability")
RECHECK = 10.0  # seconds between two looks at a deployment that had no replica
REPLICA_PROBE_MS = 200  # an online replica acknowledges a write in milliseconds (WAIT asks it at once)
_decided: Guard | None = None
_decided_at = 0.0


def guard(r: Redis, settings: Settings | None = None) -> Guard:
    global _decided, _decided_at
    settings = settings or Settings.from_env()
    stale = _decided is not None and not _decided.replicas and settings.replica_acks == "auto"
    if _decided is None or (stale and time.monotonic() - _decided_at > RECHECK):
        before, _decided = _decided, decide(r, settings)
        _decided_at = time.monotonic()
        if before is not None and _decided != before:
            log.warning("durability guard: the deployment has a replica now: %s", _decided.describe())
    return _decided


def decide(r: Redis, settings: Settings) -> Guard:
    timeout_ms = max(1, int(settings.replica_ack_timeout * 1000))
    replicas = int(settings.replica_acks) if settings.replica_acks != "auto" else _auto(r)
    waitaof = settings.waitaof
    if waitaof != "off" and not waitaof_supported(r):
        log.warning("AGENTPOOL_WAITAOF=%s: this Redis has no WAITAOF (Redis 7.2+); only WAIT applies", waitaof)
        waitaof = "off"
    return Guard(replicas=replicas, timeout_ms=timeout_ms, waitaof=waitaof)


def _auto(r: Redis) -> int:
    if isinstance(r.connection_pool, SentinelConnectionPool):
        return 1
    try:
        info = r.info("replication")
    except ResponseError:
        # INFO is in @dangerous, which the ACL user deploy/README.md suggests lacks. Waiting for a
        # replica that does not exist would make every tool with an effect wait forever on a lone
        # Redis, so ask the replicas themselves: a probe write that one of them acknowledges.
        return 1 if _a_replica_acknowledges(r) else 0
    except RedisError:
        return 1  # cannot tell: the safe side
    # A backlog stays active for repl-backlog-ttl (an hour by default) after the last replica left.
    if int(info.get("connected_slaves", 0)) > 0 or int(info.get("repl_backlog_active", 0)) > 0:
        return 1
    try:
        configured = r.config_get("min-replicas-to-write")
    except ResponseError:  # CONFIG disabled (managed Redis): what INFO said stands
        return 0
    value = configured.get(b"min-replicas-to-write", configured.get("min-replicas-to-write", 0))
    return 1 if int(value or 0) > 0 else 0


def _a_replica_acknowledges(r: Redis) -> bool:
    try:
        wait_durable(r, Guard(replicas=1, timeout_ms=REPLICA_PROBE_MS))
    except NotReplicated:
        return False
    return True


def before_fork(r: Redis) -> None:
    """In a forking worker, before it forks a work horse: decide (again, if ``RECHECK`` has passed) here,
    once, for every horse forked after it. A Redis error is left for the horse to meet."""
    try:
        guard(r)
    except RedisError as exc:
        log.warning("durability guard not decided before the fork (%s); the work horse decides", exc)


def _inherited() -> None:
    # A forked child takes its parent's decision as made now: the parent re-decides before each fork.
    global _decided_at
    if _decided is not None:
        _decided_at = time.monotonic()


os.register_at_fork(after_in_child=_inherited)


def unmet(r: Redis, settings: Settings | None = None) -> str | None:
    """Why the guard that applies cannot be met now (tried with one probe write, as a tool's guard
    would be), or None if it can or none applies: for ``agentpool check``."""
    settings = settings or Settings.from_env()
    chosen = decide(r, settings)
    if not chosen.active:
        return None
    try:
        wait_durable(r, chosen)
    except NotReplicated as exc:
        return (
            f"the durability guard cannot be met ({chosen.describe()}): {exc}. Every tool whose effect is not "
            "read waits (its run is handed back as not_replicated) until a replica acknowledges: bring a "
            "replica back, or lower AGENTPOOL_REPLICA_ACKS knowingly (docs: 'Redis high availability')"
        )
    return None


def announce(r: Redis) -> Guard:
    """Decide now and say which guard applies, once, at worker start."""
    chosen = guard(r)
    log.warning("durability guard: %s", chosen.describe())
    return chosen
