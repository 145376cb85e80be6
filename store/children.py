"""Child runs (sub-agents): started once per tool_use, joined once when the last one ends.

A parent's turn starts a child with ``spawn``: one watched transaction that, only while the turn
holds the parent's lease, marks the child open in the parent's joins hash, appends it to the parent's
children list and creates the child run with its first turn's job, each only if absent. The child's
id derives from the parent's id and the tool_use id (``child_id``), so a turn taken over after a
crash finds the children it started instead of starting new ones.

The parent then waits (``wait``: status ``waiting_children``, nothing leased or queued) unless every
child has ended already. Every write that ends a child run (save point A, ``finish``,
``fail_unfenced``, a cancel) tells the parent in the same script (``store/lua/_join.lua``): the child
is marked ended, its usage rolls up into the parent's tree counters, and the last one to end wakes the
parent with a durable ``wake`` marker that the reaper (or the child's own worker, at once) turns into
the parent's next job, exactly once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.store import writes
from agentpool.store.checkpoint import _check, stage_create
from agentpool.store.clock import now_ms
from agentpool.store.errors import LeaseLost
from agentpool.store.events import Event, script_args
from agentpool.store.keys import RUNS_WATCH, STATS, RunKeys, shard_tag
from agentpool.store.scripts import run_script

# How often the reaper looks at a run waiting for its children (a backstop: a child's end wakes it).
WAITING_RECHECK_MS = 30_000


def child_id(parent_id: str, tool_use_id: str) -> str:
    """The id of the child run that answers ``tool_use_id`` of ``parent_id``: the same on every worker
    and every retry, and a valid RQ job id part (letters, digits, ``_``, ``-``) at any depth. It keeps
    the parent's shard ending (``-s<N>``), if any: the child is created on its parent's shard, and its
    id says so to every reader."""
    digest = hashlib.blake2b(f"{parent_id}\0{tool_use_id}".encode(), digest_size=12).hexdigest()
    return f"sub_{digest}{shard_tag(parent_id)}"


def spawn(
    r: Redis,
    parent: RunKeys,
    token: str,
    child: str,
    *,
    agent: str,
    task: str,
    limits: Mapping[str, Any],
    fields: Mapping[str, Any],
    stage_enqueue: Callable[[Pipeline], None],
    now: float,
) -> bool:
    """Start ``child`` for the parent's turn holding ``token``, unless it was started already. Returns
    True if it was created now. Raises LeaseLost (nothing written) when the turn lost the lease."""
    keys = RunKeys.of(child)

    def attempt(pipe: Pipeline, write_id: str) -> bool:
        if pipe.get(parent.lease) != token.encode():
            pipe.unwatch()
            raise LeaseLost(parent.run_id)
        known = pipe.hexists(parent.joins, child)
        exists = pipe.exists(keys.run)
        if known and exists:
            pipe.unwatch()
            return False
        pipe.multi()
        if not known:
            pipe.hset(parent.joins, child, "open")
            pipe.rpush(parent.children, child)
        if not exists:
            stage_create(pipe, child, agent=agent, task=task, limits=limits, now=now)
            pipe.hset(keys.run, mapping=dict(fields))
            stage_enqueue(pipe)
        pipe.execute()
        return not exists

    return writes.watched(r, [parent.lease, parent.joins, keys.run], attempt)


def wait(r: Redis, keys: RunKeys, token: str, *, event: Event | None = None) -> bool:
    """Fenced: the turn stops holding the run, which waits for its open children. False (nothing
    changed) when every child has ended already: the turn goes on."""
    code = int(
        run_script(  # type: ignore[arg-type]
            "wait_children",
            r,
            [keys.run, keys.lease, keys.joins, RUNS_WATCH, STATS, keys.events, keys.handback],
            [token, now_ms(), now_ms() + WAITING_RECHECK_MS, keys.run_id, *script_args(event)],
        )
    )
    _check(code, keys, r)
    if code == 1 and event:
        event.log()
    return code == 1


def children(r: Redis | Pipeline, keys: RunKeys) -> list[str]:
    """The run's children in the order they were started (tool_use order within a turn)."""
    return [raw.decode() for raw in r.lrange(keys.children, 0, -1)]


def joins(r: Redis | Pipeline, keys: RunKeys) -> dict[str, str]:
    """child id -> "open" or "ended"."""
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.joins).items()}


def child_ended(r: Redis, child: str, parent_id: str) -> int:
    """Tell ``parent_id`` that ``child`` ended (the reaper's backstop for a child whose end was not
    joined: its record expired, say); 2 if that woke the parent."""
    up = RunKeys.of(parent_id)
    return int(
        run_script(  # type: ignore[arg-type]
            "child_ended",
            r,
            [RunKeys.of(child).run, RUNS_WATCH, up.run, up.joins, up.events],
            [child, parent_id, now_ms()],
        )
    )
