"""Child runs (sub-agents): started once per tool_use, joined once when the last one ends.

A parent's turn starts a child with ``spawn``: one watched transaction that, only while the turn
holds the parent's lease, marks the child open in the parent's joins hash, appends it to the parent's
children list and creates the child run with its first turn's job, each only if absent. The child's
id derives from the parent's id and the tool_use id (``child_id``), so a turn taken over after a
crash finds the children it started instead of starting new ones.

The parent then waits (``wait``: status ``waiting_children``, nothing leased or queued) unless every
child has ended already. Every write that ends a child run (save point A, ``finish``,
``fail_unfenced``, a cancel) tells the parent in the same script (``store/lua/_join.lua``): the child
is marked ended and the last one to end wakes the parent with a durable ``wake`` marker that the
reaper (or the child's own worker, at once) turns into the parent's next job, exactly once.

One budget for the tree: each model call's spend is added to every ancestor's tree counters in the
script that counts it (``store/lua/_tree.lua``), and a run that starts children records its own limits
as its tree's caps (``cap_tokens``, ``cap_usd``, ``cap_turns``). A run whose ancestor's cap is used up
stops before its next model call, held (``hold``): its parent's join stays open, and it goes on when
that ancestor is resumed; the ancestor stops with it if it waits for its children (or instead of
waiting: ``wait``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.store import webhooks, writes
from agentpool.store.checkpoint import _check, stage_create
from agentpool.store.clock import now_ms
from agentpool.store.errors import LeaseLost, RunNotActive
from agentpool.store.events import Event, script_args
from agentpool.store.keys import RUNS_WATCH, STATS, RunKeys, shard_tag
from agentpool.store.records import USAGE_FIELDS
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
    caps: Mapping[str, Any],
    stage_enqueue: Callable[[Pipeline], None],
    now: float,
) -> bool:
    """Start ``child`` for the parent's turn holding ``token``, unless it was started already. Returns
    True if it was created now. Raises LeaseLost (nothing written) when the turn lost the lease, and
    RunNotActive when the parent is no longer running (a cancel that has already read its children
    list must not miss one started after it). ``caps`` (the parent's limits: ``cap_tokens``,
    ``cap_usd``, ``cap_turns``; None where unset) go on the parent's header: its budget for the tree."""
    keys = RunKeys.of(child)

    def attempt(pipe: Pipeline, write_id: str) -> bool:
        if pipe.get(parent.lease) != token.encode():
            pipe.unwatch()
            raise LeaseLost(parent.run_id)
        status = pipe.hget(parent.run, "status")
        if status != b"running":
            pipe.unwatch()
            raise RunNotActive(parent.run_id, (status or b"?").decode("utf-8", errors="replace"))
        known = pipe.hexists(parent.joins, child)
        exists = pipe.exists(keys.run)
        if known and exists:
            pipe.unwatch()
            return False
        pipe.multi()
        set_caps = {name: value for name, value in caps.items() if value is not None}
        if set_caps:
            pipe.hset(parent.run, mapping=set_caps)
        unset = [name for name, value in caps.items() if value is None]
        if unset:
            pipe.hdel(parent.run, *unset)
        if not known:
            pipe.hset(parent.joins, child, "open")
            pipe.rpush(parent.children, child)
        if not exists:
            stage_create(pipe, child, agent=agent, task=task, limits=limits, now=now)
            pipe.hset(keys.run, mapping=dict(fields))
            stage_enqueue(pipe)
        pipe.execute()
        return not exists

    return writes.watched(r, [parent.lease, parent.run, parent.joins, keys.run], attempt)


def wait(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    parent: str = "",
    event: Event | None = None,
    stopped: tuple[str, Event] | None = None,
    pool_webhook: str = "",
) -> int:
    """Fenced: the turn stops holding the run, which waits for its open children (1). 0 (nothing
    changed) when every child has ended already: the turn goes on. When the run's budget for its
    tree is used up, it stops instead (2; 3 when that woke its ``parent``), with the reason and the
    event ``stopped`` gives."""
    up = RunKeys.of(parent) if parent else None
    why, stop_event = stopped or ("", None)
    code = int(
        run_script(  # type: ignore[arg-type]
            "wait_children",
            r,
            [keys.run, keys.lease, keys.joins, RUNS_WATCH, STATS, keys.events, keys.handback]
            + ([up.run, up.joins, up.events] if up else [])
            + webhooks.script_keys(keys),
            [
                token,
                now_ms(),
                now_ms() + WAITING_RECHECK_MS,
                keys.run_id,
                why,
                *script_args(event, stop_event),
                pool_webhook,
            ],
        )
    )
    _check(code, keys, r)
    logged = event if code == 1 else stop_event if code in (2, 3) else None
    if logged:
        logged.landed()
    return code


@dataclass(frozen=True)
class Budget:
    """An ancestor's budget for its tree as its header holds it: its caps (None where unset) and what
    it and every run below it have spent."""

    run_id: str
    parent: str
    status: str
    cap_turns: int | None
    cap_tokens: int | None
    cap_usd: float | None
    tokens: int
    cost_usd: float

    @property
    def exhausted(self) -> str | None:
        """``"max_total_tokens"`` or ``"max_cost_usd"`` when that cap is used up (as ``_tree.lua`` decides)."""
        if self.cap_tokens is not None and self.tokens >= self.cap_tokens:
            return "max_total_tokens"
        if self.cap_usd is not None and self.cost_usd >= self.cap_usd:
            return "max_cost_usd"
        return None


_BUDGET_FIELDS = [
    "status",
    "parent",
    "cap_turns",
    "cap_tokens",
    "cap_usd",
    "cost_usd",
    "tree_cost_usd",
    *USAGE_FIELDS,
    *(f"tree_{name}" for name in USAGE_FIELDS),
]


def _number(raw: bytes | None, kind: type[int | float] = int) -> Any:
    """A counter or cap of an ancestor's header; a damaged one reads as unset here (its own run's reads
    fail it with the reason)."""
    try:
        return kind(raw) if raw not in (None, b"") else None
    except ValueError:
        return None


def budgets(r: Redis, ancestors: Sequence[str]) -> list[Budget]:
    """The ancestors' budgets for their trees, in the order given (one round trip); an ancestor whose
    record is gone is left out."""
    with r.pipeline(transaction=False) as pipe:
        for run_id in ancestors:
            pipe.hmget(RunKeys.of(run_id).run, _BUDGET_FIELDS)
        rows = pipe.execute()
    out = []
    for run_id, row in zip(ancestors, rows, strict=True):
        raw = dict(zip(_BUDGET_FIELDS, row))
        if raw["status"] is None:
            continue
        usage = [_number(raw[name]) or 0 for name in USAGE_FIELDS] + [
            _number(raw[f"tree_{name}"]) or 0 for name in USAGE_FIELDS
        ]
        out.append(
            Budget(
                run_id=run_id,
                parent=(raw["parent"] or b"").decode(),
                status=raw["status"].decode("utf-8", errors="replace"),
                cap_turns=_number(raw["cap_turns"]),
                cap_tokens=_number(raw["cap_tokens"]),
                cap_usd=_number(raw["cap_usd"], float),
                tokens=sum(usage),
                cost_usd=(_number(raw["cost_usd"], float) or 0.0) + (_number(raw["tree_cost_usd"], float) or 0.0),
            )
        )
    return out


def hold(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    holder: Budget,
    reason: str,
    holder_reason: str,
    event: Event,
    holder_event: Event,
    pool_webhook: str = "",
) -> int:
    """Fenced: stop the run, held by ``holder``'s used-up budget (``store/lua/hold.lua``). Returns 1 held,
    2 held with the holder stopped too, 3 that and the holder's parent woken, 0 the holder's budget is
    not used up after all (resumed meanwhile: nothing changed, go on)."""
    up = RunKeys.of(holder.run_id)
    grand = RunKeys.of(holder.parent) if holder.parent else None
    code = int(
        run_script(  # type: ignore[arg-type]
            "hold",
            r,
            [keys.run, keys.lease, RUNS_WATCH, STATS, keys.events, keys.handback, up.run, up.events]
            + ([grand.run, grand.joins, grand.events] if grand else [])
            + [up.webhooks, *webhooks.script_keys(keys)],
            [
                token,
                now_ms(),
                keys.run_id,
                reason,
                holder.run_id,
                holder_reason,
                writes.new_id(),
                *script_args(event, holder_event),
                pool_webhook,
            ],
        )
    )
    _check(code, keys, r)
    if code >= 1:
        event.landed()
    if code >= 2:
        holder_event.landed()
    return code


def children(r: Redis | Pipeline, keys: RunKeys) -> list[str]:
    """The run's children in the order they were started (tool_use order within a turn)."""
    return [raw.decode() for raw in r.lrange(keys.children, 0, -1)]


def joins(r: Redis | Pipeline, keys: RunKeys) -> dict[str, str]:
    """child id -> "open" or "ended" (how each ended, kept under "<child id>:end", is left out)."""
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.joins).items() if b":" not in k}


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
