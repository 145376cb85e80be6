"""A run's timeline, turn by turn, from the events it already recorded (``…:events``, capped at about a
thousand: for a long run, its latest turns). For each turn: when it started and ended, the model calls
(from each ``model_responded``'s seconds), the tools (``tool_started`` to ``tool_finished``), the waits
(for a person's approval, or the backoff after a model error), takeovers, compactions, cut streams, and
the tokens and cost it spent. The dashboard draws it; it is plain data for anyone else."""

from __future__ import annotations

from typing import Any

from agentpool.store.events import stream_order

END_STATUSES = frozenset({"completed", "failed", "cancelled", "stopped"})
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def _seconds(stream_id: str) -> float:
    return stream_order(stream_id)[0] / 1000


class _Builder:
    def __init__(self) -> None:
        self.turns: dict[int, dict[str, Any]] = {}
        self.current: int | None = None
        self.tools: dict[str, dict[str, Any]] = {}
        self.wait: dict[str, Any] | None = None

    def row(self, turn: int | None) -> dict[str, Any] | None:
        if turn is None:
            return None
        return self.turns.setdefault(
            turn,
            {
                "turn": turn,
                "start": None,
                "end": None,
                "model": [],
                "tools": [],
                "waits": [],
                "takeovers": [],
                "compactions": [],
                "cuts": 0,
                "errors": 0,
                "tokens": 0,
                "cost_usd": 0.0,
                "stop_reason": None,
            },
        )

    def close_wait(self, at: float) -> None:
        if self.wait is not None:
            self.wait["end"] = at
            self.wait = None

    def spend(self, row: dict[str, Any], event: dict[str, str]) -> None:
        row["tokens"] += sum(int(event.get(name) or 0) for name in TOKEN_FIELDS)
        row["cost_usd"] += float(event.get("cost_usd") or 0)

    def add(self, at: float, event: dict[str, str]) -> None:
        kind = event.get("kind")
        turn = int(event["turn"]) if event.get("turn", "").isdigit() else self.current
        row = self.row(turn)
        if kind == "turn_started":
            self.current = turn
            self.close_wait(at)
        if row is None:
            return
        row["start"] = at if row["start"] is None else min(row["start"], at)
        row["end"] = at if row["end"] is None else max(row["end"], at)
        handler = getattr(self, f"on_{kind}", None)
        if handler is not None:
            handler(row, at, event)

    def on_model_responded(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        seconds = float(event.get("seconds") or 0)
        row["model"].append({"start": at - seconds, "end": at})
        row["stop_reason"] = event.get("stop_reason")
        self.spend(row, event)
        if event.get("compacted"):
            row["compactions"].append({"at": at - seconds, "mode": event["compacted"]})

    def on_model_cut(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        row["cuts"] += 1
        self.spend(row, event)

    def on_spend_corrected(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        self.spend(row, event)  # the rest of a call counted from its note (agentpool.store.spend)

    def on_compacted(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        seconds = float(event.get("seconds") or 0)
        row["compactions"].append({"at": at - seconds, "end": at, "mode": event.get("mode"), "why": event.get("why")})
        self.spend(row, event)

    def on_model_error(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        row["errors"] += 1
        self.wait = {"kind": "backoff", "start": at, "end": None, "error": event.get("error_type")}
        row["waits"].append(self.wait)

    def on_tool_started(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        tool = {"name": event.get("tool"), "effect": event.get("effect"), "start": at, "end": None}
        self.tools[event.get("tool_use_id", "")] = tool
        row["tools"].append(tool)

    def on_tool_finished(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        tool = self.tools.pop(event.get("tool_use_id", ""), None)
        if tool is not None:
            tool["end"] = at
            tool["is_error"] = event.get("is_error") == "True"

    def on_tool_withdrawn(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        tool = self.tools.pop(event.get("tool_use_id", ""), None)
        if tool is not None:  # the durability guard kept it from running: it ends where it started
            tool["end"] = at
            tool["withdrawn"] = event.get("reason") or True

    def on_takeover(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        row["takeovers"].append({"at": at, "cause": event.get("cause_kind")})

    def on_status(self, row: dict[str, Any], at: float, event: dict[str, str]) -> None:
        status = event.get("status")
        if status == "waiting_approval":
            self.wait = {"kind": "approval", "start": at, "end": None}
            row["waits"].append(self.wait)
        elif status == "running" or status in END_STATUSES:
            self.close_wait(at)


def timeline(events: list[tuple[str, dict[str, str]]]) -> dict[str, Any]:
    """The turns of a run from its events (``(stream id, fields)``, oldest first)."""
    builder = _Builder()
    for stream_id, event in events:
        builder.add(_seconds(stream_id), event)
    turns = [builder.turns[n] for n in sorted(builder.turns)]
    return {
        "turns": turns,
        "from": _seconds(events[0][0]) if events else None,
        "to": _seconds(events[-1][0]) if events else None,
        "events": len(events),
    }
