"""Following a run live: ``agentpool.watch(run_id)``, its events and its model's words as they arrive.

One blocking read covers the run's two streams: ``…:events`` (what ``agentpool watch`` prints: turns,
tools, takeovers, compactions, status changes) and ``…:live`` (the model call in flight; see
``agentpool.store.live``). While it reads, the watcher keeps the run's ``…:watchers`` key alive, which
is what makes workers publish a call's deltas at all; a watcher that arrives mid-call is first given
the call's output so far.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from redis import Redis

from agentpool.runtime import shards
from agentpool.runtime.progress import why_waiting
from agentpool.runtime.settings import names_the_server
from agentpool.store import live
from agentpool.store.errors import RunNotFound
from agentpool.store.events import stream_order
from agentpool.store.keys import RunKeys

END_STATUSES = frozenset({"completed", "failed", "cancelled", "stopped"})
DELTAS = frozenset({"text_delta", "thinking_delta", "input_json_delta"})
STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # an item's id, as Redis gave it to its stream
RENEW_EVERY = 3.0  # seconds between renewals of the watcher's presence (it lives live.WATCH_TTL_MS)


def _event(stream_id: str, fields: dict[str, str]) -> dict[str, Any]:
    kind = fields.pop("kind", "?")
    return {"type": kind, "id": stream_id, "at": stream_order(stream_id)[0] / 1000, **fields}


def live_item(stream_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """A live output entry as ``watch`` yields it (its text unsealed, numbers as numbers)."""
    item: dict[str, Any] = {"type": fields.pop("kind", "?"), "id": stream_id}
    if "text" in fields or "sealed" in fields:
        item["text"] = live.open_text(fields)
        fields.pop("text", None)
        fields.pop("sealed", None)
    for name in ("turn", "index"):
        if name in fields:
            item[name] = int(fields.pop(name))
    item.update(fields)
    return item


def watch(
    run_id: str,
    *,
    connection: Redis | shards.Shards | None = None,
    since_start: bool = True,
    after: str | None = None,
    live_output: bool = True,
    block_ms: int = 1000,
) -> Iterator[dict[str, Any]]:
    """Iterate over a run's events and its model's output, as they happen, until the run ends.

    Each item is a dict with a ``type``:

    - an event, as ``agentpool watch`` prints it: ``turn_started``, ``model_responded`` (with its tokens,
      cost and seconds), ``model_cut``, ``model_error``, ``tool_started``, ``tool_finished``,
      ``tool_withdrawn`` (the durability guard kept a started call from running),
      ``reconciled``, ``takeover``, ``compacted``, ``status`` ..., with its fields (strings), ``id`` (the
      stream id) and ``at`` (epoch seconds);
    - the model's output while a call streams: ``text_delta``, ``thinking_delta`` and
      ``input_json_delta`` with their ``text``, the content block's ``index``, the ``turn`` and the
      ``call`` (an id per model call); ``block_start`` (``block``: text, thinking, tool_use, compaction;
      ``name`` for a tool), ``call_start`` (``purpose``: ``reply``, or ``summary`` when agentpool
      compacts) and ``call_end`` (``outcome``);
    - ``waiting``, when what a queued or running run waits for changes (a hand-back, a backoff, a
      free worker: ``agentpool.runtime.progress``), with ``kind``, ``note``, ``since``, ``until``,
      ``reason`` and ``at`` (when it was seen).

    It starts with the events recorded so far (``since_start=False``: only new ones) and the current
    call's output so far, and ends once the run has ended (completed, failed, cancelled or stopped) and
    its last events are out. ``after``, the ``id`` of the last item a watcher was given, goes on where it
    left off instead: the events and output written after it, no earlier call's output again (a call
    that nobody watched for a while meanwhile starts over: a ``call_start``, then its text so far).
    Raises RunNotFound for an unknown run, and ``RedisUnreachable`` naming the server (without its
    password) for a Redis it cannot reach, as every API call does. ``live_output=False`` follows the
    events only (and costs the workers nothing).
    """
    if after is not None and not STREAM_ID.fullmatch(after):
        raise ValueError(f"after must be the id of an item watch gave (like '1733512345678-0'), got {after!r}")
    items = _follow(run_id, connection, since_start, after, live_output, block_ms)
    try:
        while (item := _next_item(items, connection=connection)) is not None:
            yield item
    finally:
        items.close()


@names_the_server
def _next_item(items: Iterator[dict[str, Any]], *, connection: Any) -> dict[str, Any] | None:
    """The next item (None once the run has ended). ``names_the_server`` wraps a call, and a generator's
    Redis commands run at each ``next``, not when it is called: so each ``next`` is the wrapped call."""
    return next(items, None)


def _follow(
    run_id: str,
    connection: Redis | shards.Shards | None,
    since_start: bool,
    after: str | None,
    live_output: bool,
    block_ms: int,
) -> Iterator[dict[str, Any]]:
    r = shards.route(connection, run_id)
    keys = RunKeys.of(run_id)
    if not r.exists(keys.run):
        raise RunNotFound(run_id)
    if after is not None:
        events_from = after  # the two streams' ids share the Redis server's clock: one cursor covers both
    elif since_start:
        events_from = "0-0"
    else:
        last = r.xrevrange(keys.events, count=1)
        events_from = last[0][0].decode() if last else "0-0"
    cursors = {keys.events: events_from, **({keys.live: after or "0-0"} if live_output else {})}
    renew_at = 0.0
    said = ""  # the last waiting note yielded
    while True:
        if live_output and time.monotonic() >= renew_at:
            live.mark_watching(r, keys)
            renew_at = time.monotonic() + RENEW_EVERY
        yield from _read(r, keys, cursors, block_ms)
        status = r.hget(keys.run, "status")
        if status is None or status.decode() in END_STATUSES:
            yield from _read(r, keys, {keys.events: cursors[keys.events]}, None)
            return
        waiting = why_waiting(r, run_id, status.decode())
        note = waiting.note if waiting and waiting.kind != "in_progress" else ""
        if note and note != said:
            yield {"type": "waiting", "at": time.time(), **waiting.to_dict()}  # type: ignore[union-attr]
        said = note


def _read(r: Redis, keys: RunKeys, cursors: dict[str, str], block_ms: int | None) -> Iterator[dict[str, Any]]:
    replies = r.xread(cursors, count=1000, block=block_ms) or []  # type: ignore[arg-type]
    items: list[tuple[tuple[int, int], dict[str, Any]]] = []
    for raw_key, rows in replies:  # type: ignore[union-attr]
        key = raw_key.decode()
        for stream_id, fields in live.decode_entries(rows):
            cursors[key] = stream_id
            item = _event(stream_id, fields) if key == keys.events else live_item(stream_id, fields)
            items.append((stream_order(stream_id), item))
    for _, item in sorted(items, key=lambda pair: pair[0]):
        yield item
