"""The side-effect ledger: for every tool_use, an intent written before the tool runs and an
outcome written right after. Reconcile reads it to decide what a dangling tool_use needs.

Field ``<tool_use_id>`` holds the intent, ``<tool_use_id>:out`` the outcome; both msgpack maps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from redis import Redis

from agentpool.store.codec import pack, unpack
from agentpool.store.errors import LeaseLost, LedgerMismatch, RunNotActive
from agentpool.store.events import Event, script_args
from agentpool.store.keys import STATS, RunKeys
from agentpool.store.records import SCHEMA_VERSION, open_value, seal_value
from agentpool.store.scripts import run_script


def input_digest(tool_input: Any) -> str:
    return hashlib.sha256(pack(tool_input)).hexdigest()[:32]


@dataclass(frozen=True)
class Outcome:
    content: str
    is_error: bool
    how: str = ""  # ran, replayed, verified, unknown, denied, invalid_input, not_run, unknown_tool

    def as_tool_result(self, tool_use_id: str) -> dict[str, Any]:
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_use_id, "content": self.content}
        if self.is_error:
            block["is_error"] = True
        return block


@dataclass(frozen=True)
class Entry:
    """What the ledger knows of one tool_use."""

    intent: dict[str, Any] | None
    outcome: Outcome | None

    @property
    def attempts(self) -> int:
        return int(self.intent.get("attempt", 0)) if self.intent else 0


def read(r: Redis, keys: RunKeys, tool_use_ids: list[str]) -> dict[str, Entry]:
    fields = [f for i in tool_use_ids for f in (i, f"{i}:out")]
    values = r.hmget(keys.ledger, fields) if fields else []
    entries = {}
    for n, tool_use_id in enumerate(tool_use_ids):
        intent_blob, outcome_blob = values[2 * n], values[2 * n + 1]
        intent = unpack(intent_blob, f"ledger intent {tool_use_id}") if intent_blob else None
        outcome = None
        if outcome_blob:
            record = unpack(outcome_blob, f"ledger outcome {tool_use_id}")
            if "stored_in" in record:
                raise LedgerMismatch(
                    f"ledger outcome {tool_use_id} was moved into the conversation; its turn is already committed"
                )
            content = (
                open_value(record, f"ledger outcome {tool_use_id}") if "content" not in record else record["content"]
            )
            outcome = Outcome(content=content, is_error=bool(record["is_error"]), how=record.get("how", ""))
        entries[tool_use_id] = Entry(intent, outcome)
    return entries


def check_same_call(entry: Entry, tool_use: dict[str, Any]) -> None:
    """A ledger slot replayed for a different call is a bug or tampering, never something to guess past."""
    if entry.intent is None:
        return
    if entry.intent.get("name") != tool_use["name"] or entry.intent.get("input") != input_digest(tool_use["input"]):
        raise LedgerMismatch(
            f"ledger entry for {tool_use['id']} records {entry.intent.get('name')!r} with other input than "
            f"the pending call to {tool_use['name']!r}"
        )


def fenced_hset(
    r: Redis, keys: RunKeys, token: str, hash_key: str, field: str, record: dict[str, Any], event: Event | None = None
) -> None:
    """Write ``record`` into one of the run's hashes, only while ``token`` owns the running run,
    with the ``event`` that reports it."""
    code = int(
        run_script(
            "fenced_hset",
            r,
            [keys.lease, keys.run, hash_key, keys.events, STATS],  # type: ignore[arg-type]
            [token, field, pack(record), *script_args(event)],
        )
    )
    if code == -1:
        raise LeaseLost(keys.run_id)
    if code == -2:
        raise RunNotActive(keys.run_id, (r.hget(keys.run, "status") or b"?").decode())
    if event:
        event.log()


def write_intent(
    r: Redis,
    keys: RunKeys,
    token: str,
    tool_use: dict[str, Any],
    *,
    effect: str,
    attempt: int,
    now: float,
    event: Event | None = None,
) -> None:
    record = {
        "v": SCHEMA_VERSION,
        "name": tool_use["name"],
        "input": input_digest(tool_use["input"]),
        "effect": effect,
        "attempt": attempt,
        "started_at": now,
        "owner": token,
    }
    fenced_hset(r, keys, token, keys.ledger, tool_use["id"], record, event)


def write_outcome(
    r: Redis,
    keys: RunKeys,
    token: str,
    tool_use_id: str,
    outcome: Outcome,
    *,
    how: str,
    now: float,
    event: Event | None = None,
) -> None:
    # A tool's output is sealed like the messages when encryption at rest is on.
    record = {"v": SCHEMA_VERSION, **seal_value(outcome.content), "is_error": outcome.is_error, "how": how, "at": now}
    fenced_hset(r, keys, token, keys.ledger, f"{tool_use_id}:out", record, event)


def stage_compaction(pipe: Any, keys: RunKeys, outcomes: dict[str, Outcome], now: float) -> None:
    """At save point B the results move into the conversation: keep only a note of each outcome in the
    ledger, so a large tool result is stored once. Reconcile never needs it again: the turn is over."""
    for tool_use_id, outcome in outcomes.items():
        note = {
            "v": SCHEMA_VERSION,
            "is_error": outcome.is_error,
            "how": outcome.how,
            "at": now,
            "chars": len(outcome.content),
            "stored_in": "messages",
        }
        pipe.hset(keys.ledger, f"{tool_use_id}:out", pack(note))


def read_all(r: Redis, keys: RunKeys) -> dict[str, dict[str, Any]]:
    """Every ledger record, decoded, for `agentpool show`."""
    out: dict[str, dict[str, Any]] = {}
    for field_name, blob in r.hgetall(keys.ledger).items():
        name = field_name.decode()
        tool_use_id, _, kind = name.partition(":")
        record = unpack(blob, f"ledger {name}")
        if kind and "content" not in record and "stored_in" not in record:
            record = {
                **{k: v for k, v in record.items() if k not in ("plain", "sealed")},
                "content": open_value(record, f"ledger {name}"),
            }
        out.setdefault(tool_use_id, {})["outcome" if kind else "intent"] = record
    return out
