"""Pool-wide counters, kept in one Redis hash so any process (``agentpool metrics``, a worker's
``--metrics-port``) can export them. Derived from events, so every event source counts the same way.

Field names are ``<metric>|<label>=<value>`` (or just ``<metric>``); latency histograms use
``<metric>|le=<bound>`` for the one bucket an observation falls in (not cumulative: one write per
observation instead of thirteen; the exporter adds them up), plus ``<metric>_sum`` and ``<metric>_count``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentpool.store.keys import STATS

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
# Events that report a call paid for: a committed reply, a stream cut midway, a compaction's summary call.
SPEND_EVENTS = ("model_responded", "model_cut", "compacted")


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
