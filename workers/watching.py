"""Following a run live: ``agentpool.watch(run_id)``, its events and its model's words as they arrive.

One blocking read covers the run's two streams: ``…:events`` (what ``agentpool watch`` prints: turns,
tools, takeovers, compactions, status changes) and ``…:live`` (the model call in flight; see
``agentpool.store.live``). While it reads, the watcher keeps the run's ``…:watchers`` key alive, which
is what makes workers publish a call's deltas at all; a watcher that arrives mid-call is first given
the call's output so far.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

from redis import Redis

from agentpool.runtime import shards
from agentpool.runtime.progress import why_waiting
from agentpool.runtime.settings import names_the_server
from agentpool.store import live
from agentpool.store.errors import AgentPoolError, RunNotFound
from agentpool.store.events import stream_order
from agentpool.store.keys import RunKeys
from agentpool.store.records import unpack_message

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
      cost and seconds), ``model_cut``, ``spend_corrected``, ``model_error``, ``tool_started``, ``tool_finished``,
      ``tool_withdrawn`` (the durability guard kept a started call from running),
      ``reconciled``, ``takeover``, ``compacted``, ``status`` ..., with its fields (strings), ``id`` (the
      stream id) and ``at`` (epoch seconds);
    - the model's output while a call streams: ``text_delta``, ``thinking_delta`` and
      ``input_json_delta`` with their ``text``, the content block's ``index``, the ``turn`` and the
      ``call`` (an id per model call); ``block_start`` (``block``: text, thinking, tool_use, compaction;
      ``name`` for a tool), ``call_start`` (``purpose``: ``reply``, or ``summary`` when agentpool
      compacts) and ``call_end`` (``outcome``); a reply saved after the watcher came whose call no
      worker published for it (one shorter than a worker's second between looks for watchers) comes
      the same way from the saved reply, at its ``model_responded``, ``outcome`` ``saved``;
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
    # The two streams' ids share the Redis server's clock: one cursor covers both. The latest event is
    # read only where it is used: to start from it, or to know which replies came after the watcher.
    latest = after or (_latest(r, keys.events) if live_output or not since_start else "0-0")
    events_from = "0-0" if after is None and since_start else latest
    cursors = {keys.events: events_from, **({keys.live: after or "0-0"} if live_output else {})}
    # Replies saved after this point whose words the watcher was not given live are caught up from the
    # saved reply: a worker looks for watchers when a call starts and about once a second during it, so
    # a call shorter than that, begun just before the watcher came, is never published.
    missed = _MissedCalls(r, keys, latest, given_before=after) if live_output else None
    renew_at = 0.0
    said = ""  # the last waiting note yielded
    while True:
        if live_output and time.monotonic() >= renew_at:
            live.mark_watching(r, keys)
            renew_at = time.monotonic() + RENEW_EVERY
        yield from _read(r, keys, cursors, block_ms, missed)
        status = r.hget(keys.run, "status")
        if status is None or status.decode() in END_STATUSES:
            # The last of both streams: a call's last words can be written just before the run ends, and
            # the read before the status was looked at may have had only its beginning.
            yield from _read(r, keys, cursors, None, missed)
            return
        waiting = why_waiting(r, run_id, status.decode())
        note = waiting.note if waiting and waiting.kind != "in_progress" else ""
        if note and note != said:
            yield {"type": "waiting", "at": time.time(), **waiting.to_dict()}  # type: ignore[union-attr]
        said = note


def _read(
    r: Redis, keys: RunKeys, cursors: dict[str, str], block_ms: int | None, missed: _MissedCalls | None
) -> Iterator[dict[str, Any]]:
    replies = r.xread(cursors, count=1000, block=block_ms) or []  # type: ignore[arg-type]
    items: list[tuple[tuple[int, int], dict[str, Any]]] = []
    for raw_key, rows in replies:  # type: ignore[union-attr]
        key = raw_key.decode()
        for stream_id, fields in live.decode_entries(rows):
            cursors[key] = stream_id
            item = _event(stream_id, fields) if key == keys.events else live_item(stream_id, fields)
            items.append((stream_order(stream_id), item))
    for _, item in sorted(items, key=lambda pair: pair[0]):
        if missed is not None:
            yield from missed.catch_up(item)
        yield item


def _latest(r: Redis, key: str) -> str:
    last = r.xrevrange(key, count=1)
    return last[0][0].decode() if last else "0-0"


class _MissedCalls:
    """The replies a watcher was not given live: for a ``model_responded`` after ``since`` whose turn had
    no ``call_start`` in the live output, the saved reply as one call's items (``call_start``, a delta
    per content block, ``call_end`` with ``outcome`` ``saved``), each with that event's id, so that
    ``after=`` the event goes on past them too."""

    def __init__(self, r: Redis, keys: RunKeys, since: str, given_before: str | None) -> None:
        self.r, self.keys, self.since = r, keys, stream_order(since)
        self.streamed: set[int] = set()  # turns whose reply the live output began
        if given_before is not None:  # a watcher going on: the call it was given the start of (the live
            # stream holds one call at a time, at most LIVE_MAXLEN entries)
            for _, fields in live.decode_entries(r.xrange(keys.live, "-", given_before)):
                self.saw(fields.get("kind"), fields)

    def saw(self, kind: str | None, item: dict[str, Any]) -> bool:
        """Whether ``item`` (of ``kind``) began a reply's call in the live output; noted if so."""
        if kind != "call_start" or item.get("purpose", "reply") != "reply":
            return False
        self.streamed.add(int(item.get("turn", -1)))
        return True

    def catch_up(self, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if self.saw(item["type"], item):
            return
        if item["type"] != "model_responded" or stream_order(item["id"]) <= self.since:
            return
        turn, index = item.get("turn", ""), item.get("message", "")
        if not (turn.isdigit() and index.isdigit()) or int(turn) in self.streamed:
            return
        blob = self.r.lindex(self.keys.messages, int(index))
        try:
            message = unpack_message(blob, int(index)) if blob else None
        except AgentPoolError:  # sealed without the key here, or damaged: the events still say what happened
            return
        if not message or message["role"] != "assistant" or isinstance(message["content"], str):
            return
        base = {"id": item["id"], "turn": int(turn), "call": f"saved:{turn}"}
        yield {"type": "call_start", **base, "purpose": "reply"}
        for n, block in enumerate(message["content"]):
            kind, text = _as_delta(block)
            if kind:
                yield {"type": "block_start", **base, "index": n, "block": block["type"], **_named(block)}
                yield {"type": kind, **base, "index": n, "text": text, **_named(block)}
        yield {"type": "call_end", **base, "outcome": "saved"}


def _as_delta(block: dict[str, Any]) -> tuple[str, str]:
    """A saved content block as the live delta that would have carried it (its kind, its text)."""
    if block["type"] == "text":
        return "text_delta", str(block.get("text", ""))
    if block["type"] == "thinking":
        return "thinking_delta", str(block.get("thinking", ""))
    if block["type"] == "tool_use":
        return "input_json_delta", json.dumps(block.get("input"), ensure_ascii=False)
    return "", ""


def _named(block: dict[str, Any]) -> dict[str, Any]:
    return {"name": block["name"]} if block["type"] == "tool_use" and block.get("name") else {}
