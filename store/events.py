"""Progress events, one capped Redis stream per run, each also counted pool-wide and logged.

An event that reports a write of the turn (a tool started, save point A, a status change...) is
recorded by that write itself, in the same Lua script or MULTI (``script_args``, ``Event.stage``):
it exists exactly when the write does, a fenced-out zombie leaves none, and it costs no round trip
of its own. ``emit`` records the others, best effort: it never fails a turn. Either way an event is
safe to deliver twice (it rides in a write that is, or carries a write id of its own): the pool-wide
counters never count a re-sent event again. In a worker process the counters are added to the
process's tally once the write has landed (``Event.landed``) and flushed about once a second
(``agentpool.store.stats``); elsewhere the write adds them itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from agentpool.store import stats, writes
from agentpool.store.codec import safe_text
from agentpool.store.keys import STATS, RunKeys
from agentpool.store.scripts import run_script

MAX_EVENTS = 1000
log = logging.getLogger("agentpool.events")


@dataclass(frozen=True)
class Event:
    run_id: str
    kind: str
    fields: Mapping[str, str]  # no secrets and no tool inputs or outputs: they are for operators' eyes
    counters: Mapping[str, float]

    @classmethod
    def of(cls, run_id: str, kind: str, **fields: Any) -> Event:
        """``None`` fields are left out; the pool-wide counters are derived from the event. Texts (an
        error, a tool name the model made up) are made safe to store (``codec.safe_text``)."""
        return cls(
            run_id,
            kind,
            {k: safe_text(str(v)) for k, v in fields.items() if v is not None},
            {k: v for k, v in stats.counters_for(kind, fields).items() if v},
        )

    def _script_args(self) -> list[str | int | float]:
        pairs = [x for item in {"kind": self.kind, **self.fields}.items() for x in item]
        counted = [] if stats.local() else [x for item in self.counters.items() for x in item]
        return [MAX_EVENTS, len(pairs) // 2, *pairs, len(counted) // 2, *counted]

    def stage(self, pipe: Any) -> None:
        """Add the event to a pipeline or MULTI the caller executes; once it has, ``landed()``."""
        pipe.xadd(
            RunKeys.of(self.run_id).events, {"kind": self.kind, **self.fields}, maxlen=MAX_EVENTS, approximate=True
        )
        if not stats.local():
            stats.stage(pipe, self.counters)

    def landed(self) -> None:
        """The write that records the event has landed: its counters go into this process's tally (a
        worker's; elsewhere the write added them) and its log line is written."""
        stats.count(self.counters)
        self.log()

    def log(self) -> None:
        """One structured line on the ``agentpool.events`` logger."""
        if log.isEnabledFor(logging.INFO):  # building the line costs more than the event's Redis write
            log.info("%s", json.dumps({"run": self.run_id, "kind": self.kind, **self.fields}, ensure_ascii=False))


def script_args(*events: Event | None) -> list[str | int | float]:
    """The script arguments ``record_event`` in ``store/lua/_event.lua`` reads, one event after the
    other: the stream's cap, the field/value pairs, the counter/amount pairs, each list preceded by
    its length; a lone 0 for an event not given."""
    return [x for event in events for x in (event._script_args() if event else [0])]


def emit(r: Redis, run_id: str, kind: str, **fields: Any) -> None:
    """Record an event that reports no write of its own (best effort). Dropped for a run that no
    longer exists."""
    event = Event.of(run_id, kind, **fields)
    event.log()  # the log line does not depend on Redis being there
    keys = RunKeys.of(run_id)
    try:
        recorded = run_script("emit_event", r, [keys.run, keys.events, STATS], [writes.new_id(), *script_args(event)])
    except RedisError as exc:
        log.warning("could not record event %s for run %s: %s", kind, run_id, exc)
        return
    if recorded:
        stats.count(event.counters)


def stream_order(stream_id: str) -> tuple[int, int]:
    """A stream entry id as (milliseconds of Redis's clock at the write, sequence): ids sort by it."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def read(
    r: Redis, run_id: str, after: str = "0-0", count: int = 1000, block_ms: int | None = None
) -> list[tuple[str, dict[str, str]]]:
    key = RunKeys.of(run_id).events
    if block_ms is None:
        rows = r.xrange(key, min=f"({after}" if after != "0-0" else "-", count=count)
    else:
        got = r.xread({key: after}, count=count, block=block_ms) or []
        rows = got[0][1] if got else []
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in rows]


def latest(r: Redis, run_id: str, count: int = 20) -> list[tuple[str, dict[str, str]]]:
    """The newest ``count`` events, newest first."""
    rows = r.xrevrange(RunKeys.of(run_id).events, count=count)
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in rows]
