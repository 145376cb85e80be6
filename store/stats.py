"""Pool-wide counters, kept in one Redis hash so any process (``agentpool metrics``, a worker's
``--metrics-port``) can export them. Derived from events, so every event source counts the same way.

Where they are added up: a worker process (``accumulate()``) adds an event's counters to a tally of its
own once the write that records the event has landed, and flushes the tally into the hash about once
a second (``flush``, one script call, safe to deliver twice): a turn's dozen counters cost Redis no
command of their own, and a process killed outright loses at most the last second's counts. Any other
process (an app, the CLI, a test driving the store) adds them inside the write itself, as before.

Field names are ``<metric>|<label>=<value>`` (or just ``<metric>``); latency histograms use
``<metric>|le=<bound>`` for the one bucket an observation falls in (not cumulative: one write per
observation instead of thirteen; the exporter adds them up), plus ``<metric>_sum`` and ``<metric>_count``.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

from agentpool.store.keys import STATS, stats_flush_key
from agentpool.store.scripts import run_script

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
# Events that report a call paid for, one each: a committed reply, a stream cut midway (or a call counted
# from its note by a takeover), a compaction's summary call.
CALL_EVENTS = ("model_responded", "model_cut", "compacted")
# And every event that carries spend: besides those, the rest of a call a takeover had counted from its
# note, counted by the worker fenced out of it once it had the whole reply (no call of its own).
SPEND_EVENTS = (*CALL_EVENTS, "spend_corrected")


def _histogram(name: str, seconds: float) -> dict[str, float]:
    bound = next(b for b in LATENCY_BUCKETS if seconds <= b)
    fields = {f"{name}|le={'+Inf' if bound == float('inf') else bound}": 1.0}
    fields[f"{name}_sum"] = seconds
    fields[f"{name}_count"] = 1.0
    return fields


def counters_for(kind: str, fields: Mapping[str, Any]) -> dict[str, float]:
    """What one event adds to the pool-wide counters."""
    if kind == "turn_started":
        return {"turns": 1}
    if kind == "tool_started":
        return {f"tool_calls|effect={fields.get('effect', '?')}": 1}
    if kind == "tool_withdrawn":  # its tool_started was counted, but the guard kept the call from running
        return {f"tool_calls|effect={fields.get('effect', '?')}": -1}
    if kind in ("reconciled", "tool_skipped"):
        return {f"reconciliations|outcome={fields.get('outcome', '?')}": 1} if kind == "reconciled" else {}
    if kind == "takeover":
        return {f"takeovers|cause={fields.get('cause_kind', '?')}": 1}
    if kind == "waiting_for_budget":  # no turn happened: its turn_started is taken back
        return {f"budget_waits|model={fields.get('model', '?')}": 1, "turns": -1}
    if kind == "waiting_for_slot":
        return {f"concurrency_waits|key={fields.get('key', '?')}": 1, "turns": -1}
    if kind == "model_error":
        return {f"model_errors|type={fields.get('error_type', '?')}": 1}
    if kind in SPEND_EVENTS:
        counts = {f"tokens|kind={name}": float(fields.get(name) or 0) for name in TOKEN_FIELDS}
        counts["cost_usd"] = float(fields.get("cost_usd") or 0)
        if kind == "compacted":
            counts[f"compactions|mode={fields.get('mode', '?')}"] = 1
        if kind == "model_responded" and fields.get("compacted"):
            counts[f"compactions|mode={fields['compacted']}"] = 1
        if kind == "model_responded" and fields.get("seconds") is not None:
            counts.update(_histogram("model_call_seconds", float(fields["seconds"])))
        return counts
    if kind == "turn_committed" and fields.get("seconds") is not None:
        return _histogram("turn_seconds", float(fields["seconds"]))
    if kind == "status":
        return {f"status_changes|status={fields.get('status', '?')}": 1}
    return {}


def stage(pipe: Any, counters: Mapping[str, float]) -> None:
    for field, amount in counters.items():
        if amount:
            pipe.hincrbyfloat(STATS, field, amount)


def read_all(r: Any) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(STATS).items()}


class Tally:
    """Counters added up in this process until the next flush."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time (the flush thread, a last one at exit)
        self._pending: dict[str, float] = {}
        # A flush sent but not known to have landed, with its id: sent again as it was, so it adds once.
        self._inflight: dict[str, float] | None = None
        self._flush_id = ""

    def add(self, counters: Mapping[str, float]) -> None:
        with self._lock:
            for field, amount in counters.items():
                if amount:
                    self._pending[field] = self._pending.get(field, 0.0) + amount

    def take(self) -> dict[str, float]:
        """Everything counted and not yet flushed (a forked work horse hands it to its worker)."""
        with self._lock:
            taken, self._pending = self._pending, {}
            if self._inflight is not None:  # never the case in a horse, which does not flush
                for field, amount in self._inflight.items():
                    taken[field] = taken.get(field, 0.0) + amount
                self._inflight = None
            return taken

    def flush(self, r: Any) -> None:
        """Add what was counted to ``ap:stats``. On a Redis error the flush is kept and sent again, as it
        was and under the same id, by the next call: whether its first delivery landed or not, it adds once."""
        with self._flushing:
            with self._lock:
                if self._inflight is None:
                    if not self._pending:
                        return
                    self._inflight, self._pending = self._pending, {}
                    self._flush_id = secrets.token_hex(8)
                counted, flush_id = self._inflight, self._flush_id
            args = [x for item in counted.items() for x in item]
            run_script("stats_flush", r, [STATS, stats_flush_key(flush_id)], args)
            with self._lock:
                self._inflight = None


_tally: Tally | None = None


def accumulate() -> Tally:
    """Count in this process from now on (a worker's); the caller flushes the tally regularly."""
    global _tally
    if _tally is None:
        _tally = Tally()
    return _tally


def stop_accumulating() -> None:
    """Count inside each write again (a forked process whose parent's tally it must not share)."""
    global _tally
    _tally = None


def local() -> bool:
    """Whether this process adds counters up itself (not inside the writes)."""
    return _tally is not None


def count(counters: Mapping[str, float]) -> None:
    """Counters of an event whose write has landed: into this process's tally (no-op elsewhere, where the
    write itself added them)."""
    if _tally is not None and counters:
        _tally.add(counters)


_handing: Callable[[], None] | None = None


def hand_over_to(send: Callable[[], None] | None) -> None:
    """In a forked work horse: how to hand what it counted so far to its worker (``hand_over``). A
    horse killed mid-turn then loses what it counted since its last milestone, not its whole turn."""
    global _handing
    _handing = send


def hand_over() -> None:
    """A turn's milestone (its lease taken, save point A, a tool about to run): a forked work horse hands
    its counters to its worker now; anywhere else, nothing."""
    if _handing is not None:
        _handing()
