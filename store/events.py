"""Progress events, one capped Redis stream per run. Best effort: an event never fails a turn."""

from __future__ import annotations

import json
import logging
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from store import stats
from store.keys import RunKeys

MAX_EVENTS = 1000
log = logging.getLogger("agentpool.events")


def emit(r: Redis, run_id: str, kind: str, **fields: Any) -> None:
    """Record an event in the run's stream, count it pool-wide, and log it as one structured line.

    Fields must not carry secrets or tool inputs; they are for operators' eyes.
    """
    data = {"kind": kind, **{k: str(v) for k, v in fields.items() if v is not None}}
    if log.isEnabledFor(logging.INFO):  # building the line costs more than the event's Redis write
        log.info("%s", json.dumps({"run": run_id, **data}, ensure_ascii=False))
    try:
        with r.pipeline(transaction=False) as pipe:
            pipe.xadd(RunKeys.of(run_id).events, data, maxlen=MAX_EVENTS, approximate=True)
            stats.stage(pipe, stats.counters_for(kind, fields))
            pipe.execute()
    except RedisError as exc:
        log.warning("could not record event %s for run %s: %s", kind, run_id, exc)


def read(r: Redis, run_id: str, after: str = "0-0", count: int = 1000, block_ms: int | None = None) -> list[tuple[str, dict[str, str]]]:
    key = RunKeys.of(run_id).events
    if block_ms is None:
        rows = r.xrange(key, min=f"({after}" if after != "0-0" else "-", count=count)
    else:
        got = r.xread({key: after}, count=count, block=block_ms) or []
        rows = got[0][1] if got else []
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in rows]
