"""Live output: the model call in flight, as it streams, for whoever watches the run.

Nothing here touches the checkpoint. A watcher (``agentpool watch``, ``agentpool.watch()``, the
dashboard) keeps ``…:watchers`` alive while it watches, and the pool-wide ``ap:watching`` with it; a
worker whose turn streams writes to the run's ``…:live`` stream only while that key exists (it looks
when the call starts, in the round trip that loads the run, and again about once a second), so a run
nobody watches costs nothing at all. While nobody watched any run at all a moment ago (``NOBODY_FOR``),
a worker process skips the first look too (``WatchLookup``): a turn then costs Redis no command for
it. A watcher that arrives mid-call is caught up: the worker's first write then carries the call's text
so far.

Entries (stream fields, all strings): ``kind`` (``call_start``, ``block_start``, ``text_delta``,
``thinking_delta``, ``input_json_delta``, ``call_end``), ``turn``, ``call`` (one id per model call),
and per kind ``index`` (the content block), ``block`` and ``name`` (a block's type, a tool's name),
``text`` (or ``sealed`` when encryption at rest is on: conversation text is sealed like the messages),
``purpose`` (``reply``, or ``summary`` for a compaction summary), ``outcome``. The stream is capped
(``LIVE_MAXLEN`` entries of at most ``CHUNK_CHARS`` characters each) and expires ``LIVE_TTL_MS`` after
its last write; a new call starts it afresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.store import crypto
from agentpool.store.hints import Hints, pool_key
from agentpool.store.keys import ANYONE_WATCHING, RunKeys

LIVE_MAXLEN = 512
LIVE_TTL_MS = 120_000
CHUNK_CHARS = 2048
WATCH_TTL_MS = 10_000  # a watcher renews its presence well within this


# Seconds a worker process trusts "no run is watched" (``ap:watching`` absent) before it looks again:
# the model call's own looks (every second, agentpool.runtime.stream) find a watcher who arrives meanwhile.
NOBODY_FOR = 1.0
nobody_watched = Hints()  # "no run of the pool watched", per connection pool (a shard)


def mark_watching(r: Redis, keys: RunKeys, ttl_ms: int = WATCH_TTL_MS) -> None:
    with r.pipeline(transaction=False) as pipe:
        pipe.set(keys.watchers, b"1", px=ttl_ms)
        pipe.set(ANYONE_WATCHING, b"1", px=ttl_ms)  # set after the run's: it never expires first
        pipe.execute()


class WatchLookup:
    """Whether a turn's run is watched, read in the round trip that loads it: one ``EXISTS`` of
    ``ap:watching`` and the run's ``watchers`` (2: watched), and none at all while this process found no
    run watched less than ``NOBODY_FOR`` ago."""

    def __init__(self, r: Redis) -> None:
        self._pool = pool_key(r)
        self._staged = False

    def stage(self, pipe: Pipeline, keys: RunKeys) -> None:
        # Decided afresh at every call: a round trip sent again (a script cache miss stages its reads
        # anew) may find the hint set meanwhile by another turn of this process, and then stages nothing.
        self._staged = not nobody_watched.holds(self._pool)
        if self._staged:
            pipe.exists(ANYONE_WATCHING, keys.watchers)

    def watched(self, replies: list[Any]) -> bool:
        """From the replies that followed the run's (none if nothing was staged)."""
        if not self._staged:
            return False
        found = int(replies[0])
        if found == 0:
            nobody_watched.remember(self._pool, NOBODY_FOR)
        return found == 2


def is_watched(r: Redis, keys: RunKeys) -> bool:
    return bool(r.exists(keys.watchers))


def seal_text(text: str) -> dict[str, str]:
    cipher = crypto.active()
    return {"sealed": cipher.seal(text.encode()).decode()} if cipher else {"text": text}


def open_text(fields: Mapping[str, str]) -> str:
    """An entry's text; "(sealed)" for a process without the key."""
    if "sealed" not in fields:
        return fields.get("text", "")
    try:
        return crypto.open_sealed(fields["sealed"].encode(), "live output").decode()
    except Exception:  # noqa: BLE001 - a watcher without the key still follows the run
        return "(sealed)"


def stage_entries(pipe: Pipeline, keys: RunKeys, entries: list[dict[str, Any]], *, reset: bool) -> None:
    """Append ``entries`` to the live stream (a fresh one when ``reset``), split into bounded chunks."""
    if reset:
        pipe.delete(keys.live)
    for entry in entries:
        text = entry.get("text")
        pieces = [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] if text else [None]
        for piece in pieces:
            fields = {k: str(v) for k, v in entry.items() if v is not None and k != "text"}
            if piece is not None:
                fields.update(seal_text(piece))
            pipe.xadd(keys.live, fields, maxlen=LIVE_MAXLEN, approximate=True)  # type: ignore[arg-type]
    pipe.pexpire(keys.live, LIVE_TTL_MS)


def decode_entries(rows: list[Any]) -> list[tuple[str, dict[str, str]]]:
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in rows]
