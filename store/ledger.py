"""The side-effect ledger: for every tool_use, an intent written before the tool runs and an
outcome written right after. Reconcile reads it to decide what a dangling tool_use needs.

Field ``<tool_use_id>`` holds the intent, ``<tool_use_id>:out`` the outcome; both msgpack maps.
An intent records who started the call (``owner``, the lease token), when (``started_at``) and the
tool's ``timeout``, so a worker taking the run over knows until when that attempt may still be
running; ``ended_at`` is added once the owner's process is known to be gone (``mark_ended``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.store import crypto, writes
from agentpool.store.codec import pack, unpack
from agentpool.store.errors import LeaseLost, LedgerMismatch, RunNotActive, TurnMoved, UnreadableRecord
from agentpool.store.events import Event, script_args
from agentpool.store.keys import STATS, RunKeys
from agentpool.store.records import SCHEMA_VERSION, open_value, seal_value
from agentpool.store.scripts import run_script


def input_digest(tool_input: Any) -> str:
    """What binds a ledger intent or an approval to its call's input. Keyed (``crypto.Cipher.digest``)
    when encryption at rest is on: the input itself is sealed, and a plain hash would let anyone with a
    dump confirm guesses of it. Without encryption the input is stored in clear anyway: a plain SHA-256."""
    cipher = crypto.active()
    data = pack(tool_input)
    return cipher.digest(data) if cipher else hashlib.sha256(data).hexdigest()[:32]


def same_input(recorded: Any, tool_input: Any) -> bool:
    """Whether a digest on record was made of ``tool_input``: under any key this process has (a key
    rotation), or plainly (a record written before encryption was turned on). A keyed digest in a
    process without any key raises ``EncryptionKeyMissing``."""
    if not isinstance(recorded, str):
        return False
    data = pack(tool_input)
    cipher = crypto.active()
    if cipher is None and recorded.startswith(crypto.DIGEST_PREFIX):
        # Made under a key (encryption at rest was turned on by a worker that has one): this process
        # cannot tell, which is no mismatch. Its turn is handed back for a worker with the key.
        raise crypto.EncryptionKeyMissing("a digest on record is keyed, and this process has no encryption key")
    candidates = [hashlib.sha256(data).hexdigest()[:32], *(cipher.digests(data) if cipher else [])]
    return any(hmac.compare_digest(recorded, candidate) for candidate in candidates)


@dataclass(frozen=True)
class Outcome:
    content: str
    is_error: bool
    how: str = ""  # ran, replayed, verified, unknown, denied, invalid_input, not_run, unknown_tool
    # The tool's name, kept with the outcome for readers (`show`, the dashboard) of a call that never
    # ran (denied, refused input): it has no intent to name it.
    tool: str = ""

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
        if intent is not None and intent.get("withdrawn"):
            intent = None  # the durability guard stopped the call before it ran: as if never started
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
            outcome = Outcome(
                content=content,
                is_error=bool(record["is_error"]),
                how=record.get("how", ""),
                tool=record.get("name", ""),
            )
        entries[tool_use_id] = Entry(intent, outcome)
    return entries


def check_same_call(entry: Entry, tool_use: dict[str, Any]) -> None:
    """A ledger slot replayed for a different call is a bug or tampering, never something to guess past."""
    if entry.intent is None:
        return
    if entry.intent.get("name") != tool_use["name"] or not same_input(entry.intent.get("input"), tool_use["input"]):
        raise LedgerMismatch(
            f"ledger entry for {tool_use['id']} records {entry.intent.get('name')!r} with other input than "
            f"the pending call to {tool_use['name']!r}"
        )


# Where a turn believes its run is: (turns counted, phase). A fenced write given one lands only there.
At = tuple[int, str]


def fenced_hset(
    r: Redis,
    keys: RunKeys,
    token: str,
    hash_key: str,
    field: str,
    record: dict[str, Any],
    event: Event | None = None,
    at: At | None = None,
) -> None:
    """Write ``record`` into one of the run's hashes, only while ``token`` owns the running run (and,
    given ``at``, the run is at those turns and phase), with the ``event`` that reports it."""
    code = int(
        run_script(
            "fenced_hset",
            r,
            [keys.lease, keys.run, hash_key, keys.events, STATS],  # type: ignore[arg-type]
            [token, field, pack(record), *(at if at else ("", "")), *script_args(event)],
        )
    )
    if code == -1:
        raise LeaseLost(keys.run_id)
    if code == -2:
        raise RunNotActive(keys.run_id, (r.hget(keys.run, "status") or b"?").decode())
    if code == -3 and at:
        raise TurnMoved(keys.run_id, f"{field} was to be written at turn count {at[0]}, phase {at[1]}")
    if event:
        event.landed()


def write_intent(
    r: Redis,
    keys: RunKeys,
    token: str,
    tool_use: dict[str, Any],
    *,
    effect: str,
    attempt: int,
    now: float,
    timeout: float | None = None,
    event: Event | None = None,
    at: At | None = None,
) -> dict[str, Any]:
    record = intent_record(tool_use, token, effect=effect, attempt=attempt, now=now, timeout=timeout)
    fenced_hset(r, keys, token, keys.ledger, tool_use["id"], record, event, at)
    return record


def intent_record(
    tool_use: dict[str, Any], token: str, *, effect: str, attempt: int, now: float, timeout: float | None = None
) -> dict[str, Any]:
    """What an intent records: the call (name, input digest), its effect class, which attempt, when and
    by whom it started, and the tool's timeout."""
    record = {
        "v": SCHEMA_VERSION,
        "name": tool_use["name"],
        "input": input_digest(tool_use["input"]),
        "effect": effect,
        "attempt": attempt,
        "started_at": now,
        "owner": token,
    }
    if timeout is not None:
        record["timeout"] = timeout
    return record


def withdraw_intent(
    r: Redis,
    keys: RunKeys,
    token: str,
    tool_use_id: str,
    record: dict[str, Any],
    event: Event | None = None,
    at: At | None = None,
) -> None:
    """Mark an intent as not acted on: the durability guard refused to run its call (fenced, like the
    intent), with the ``event`` that says so. If a failover loses this mark but keeps the intent, the
    call reads "started, no outcome": never run twice, at worst reported unknown."""
    fenced_hset(r, keys, token, keys.ledger, tool_use_id, {**record, "withdrawn": True}, event, at)


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
    at: At | None = None,
) -> None:
    # A tool's output is sealed like the messages when encryption at rest is on.
    record = {"v": SCHEMA_VERSION, **seal_value(outcome.content), "is_error": outcome.is_error, "how": how, "at": now}
    if outcome.tool:
        record["name"] = outcome.tool
    fenced_hset(r, keys, token, keys.ledger, f"{tool_use_id}:out", record, event, at)


def mark_ended(r: Redis, keys: RunKeys, holder: str, now: float) -> int:
    """Record that process ``holder`` (``<worker>.<pid>``, the end of its lease tokens) is gone, with
    every process it started: the calls it started and left without an outcome can no longer take
    effect, so reconcile need not wait out their timeout. Only for a process known to be dead and its
    process group known to be empty. Returns how many intents were marked."""

    def attempt(pipe: Pipeline, _write_id: str) -> int:  # marking twice marks nothing more: no write id
        fields: dict[bytes, bytes] = pipe.hgetall(keys.ledger)  # type: ignore[assignment]
        marked = {}
        for name, blob in fields.items():
            if b":" in name or name + b":out" in fields:
                continue
            try:
                intent = unpack(blob, "ledger intent")
            except UnreadableRecord:
                continue  # its turn will fail on it; nothing to mark
            owner = intent.get("owner") if isinstance(intent, dict) else None
            if isinstance(owner, str) and owner.endswith(f":{holder}") and "ended_at" not in intent:
                marked[name] = pack({**intent, "ended_at": now})
        if not marked:
            pipe.unwatch()
            return 0
        pipe.multi()
        pipe.hset(keys.ledger, mapping=marked)  # type: ignore[arg-type]
        pipe.execute()
        return len(marked)

    return writes.watched(r, [keys.ledger], attempt)


def compaction_notes(outcomes: dict[str, Outcome], now: float) -> dict[str, bytes]:
    """At save point B the results move into the conversation: the ledger keeps only a note of each
    outcome (these ledger fields), so a large tool result is stored once. Reconcile never needs it
    again: the turn is over."""
    notes = {}
    for tool_use_id, outcome in outcomes.items():
        note = {
            "v": SCHEMA_VERSION,
            "is_error": outcome.is_error,
            "how": outcome.how,
            "at": now,
            "chars": len(outcome.content),
            "stored_in": "messages",
        }
        if outcome.tool:
            note["name"] = outcome.tool
        notes[f"{tool_use_id}:out"] = pack(note)
    return notes


def stage_compaction(pipe: Any, keys: RunKeys, outcomes: dict[str, Outcome], now: float) -> None:
    """``compaction_notes`` in the caller's MULTI."""
    notes = compaction_notes(outcomes, now)
    if notes:
        pipe.hset(keys.ledger, mapping=notes)


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
