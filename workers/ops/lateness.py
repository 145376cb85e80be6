"""How late deferred turns started: each ``model_error`` event's ``retry_at`` (when the turn was due)
against the ``turn_started`` event of the same turn that followed it. For the bench and the tests'
reports; the clock of a stream id is Redis's, ``retry_at`` the worker's (the same machine here)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from redis import Redis

from agentpool.store.events import read


def deferred_lateness(r: Redis, run_id: str) -> list[float]:
    """Seconds between each deferred turn's due time and its start, in order; a deferral whose turn
    has not started yet is left out."""
    found, due = [], None
    after = "0-0"
    while rows := read(r, run_id, after=after):
        for event_id, fields in rows:
            if fields.get("kind") == "model_error" and fields.get("retry_at"):
                due = (fields.get("turn"), float(fields["retry_at"]))
            elif fields.get("kind") == "turn_started" and due and fields.get("turn") == due[0]:
                found.append(int(event_id.split("-")[0]) / 1000 - due[1])
                due = None
        after = rows[-1][0]
    return found


def percentile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
