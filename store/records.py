"""Run records as they sit in Redis, and their schema versions.

The header is a flat hash so that Lua can count tokens and turns with HINCRBY; structured fields
(pending tool_uses, per-run limits) are msgpack blobs inside it. Each message is its own msgpack blob
in a list, so a save appends what the turn added and never rewrites the history.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentpool.store import crypto
from agentpool.store.codec import pack, safe_text, unpack
from agentpool.store.errors import SchemaTooNew, UnreadableRecord

# 1: the first release. 2: the header counts cost (``cost_usd``), usage counts every call paid for
# (recorded when the reply arrives, so a call whose turn was lost to a crash still counts), and the
# run's limits may carry extras granted by ``resume``. 3: a run may hold compaction points (``compaction``
# blocks, summaries) and the header's ``window`` says where the next request starts; an older worker
# would send the whole history, which the API refuses, so it must leave such a run alone.
SCHEMA_VERSION = 3

ACTIVE_STATUSES = frozenset({"queued", "running"})
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
# waiting_children: the run's turn waits for the child runs (sub-agents) it started; nothing is leased.
STATUSES = ACTIVE_STATUSES | TERMINAL_STATUSES | {"waiting_approval", "waiting_children", "stopped"}
# A child run in one of these has ended as far as its parent is concerned: its result (or error) answers
# the parent's tool_use. Not a child stopped because the tree's budget ran out (``held``): its parent's
# join stays open, and it goes on when the tree is resumed (``agentpool.runtime.tree``).
ENDED_FOR_PARENT = TERMINAL_STATUSES | {"stopped"}
USAGE_FIELDS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


# Upgrades of a decoded header, keyed by the version they upgrade from. Each returns the header in
# the next version's shape; load_header applies them in order, in memory (the record in Redis is
# rewritten only by the next fenced save, so a rollback of workers still reads it).
def _v1_to_v2(fields: dict[str, Any]) -> dict[str, Any]:
    # v1 did not price calls: cost starts at zero (its usage counters carry over as they are).
    return {**fields, "cost_usd": fields.get("cost_usd", b"0"), "v": 2}


def _v2_to_v3(fields: dict[str, Any]) -> dict[str, Any]:
    # v2 never compacted: the window is the whole conversation.
    return {**fields, "window": fields.get("window", b"0"), "v": 3}


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2, 2: _v2_to_v3}


@dataclass
class RunState:
    """A run as loaded from Redis: header fields and the whole conversation."""

    id: str
    agent: str
    status: str
    turns: int
    phase: str  # "model": next is a model call; "tools": pending tool_uses await results; "done"
    pending: list[dict[str, Any]]
    usage: dict[str, int]
    limits: dict[str, Any]
    error: str
    result: str
    created_at: float
    updated_at: float
    model_errors: int
    cost_usd: float = 0.0
    version: int = SCHEMA_VERSION
    messages: list[dict[str, Any]] = field(default_factory=list)
    window_hint: int = 0  # the header's ``window``: the latest compaction point it knows of (never ahead)
    window_start: int = 0  # index of ``messages[0]`` in the whole conversation when only the window was loaded
    last_reply: dict[str, Any] = field(default_factory=dict)  # meta of the newest reply in the window, if loaded
    last_call: str = ""  # the API's id of the newest call saved in the window (a reply, or its summary)
    forked_from: str = ""  # the run this one was forked from (``fork_run``), and at which of its turns
    forked_at: int = 0
    queue: str = "default"  # the queue its turns go to (the header's ``queue``; none: ``default``)
    concurrency_key: str = ""  # its fair-share key (the header's ``ckey``) and the run's own limit (``cmax``)
    max_concurrency: int = 0
    # Sub-agents: the parent run's id ("" for a top-level run), the parent's tool_use this run answers,
    # and how deep in the tree it is (0 at the top). ``usage`` and ``cost_usd`` are the whole tree's (this
    # run's and its ended children's, rolled up as each ends); ``own_usage`` and ``own_cost_usd`` its own.
    parent: str = ""
    parent_call: str = ""
    depth: int = 0
    own_usage: dict[str, int] = field(default_factory=dict)
    own_cost_usd: float = 0.0
    # Every run above it, the parent first: each call's spend is added to their tree counters as it is
    # counted, and each one's budget is checked before this run's model calls. ``parent_tool`` and
    # ``parent_chars`` (the parent's tool name and max_result_chars) shape an answer that reaches the
    # parent late (``agentpool.runtime.subagents.late_answer``). ``held``: the ancestor whose budget for
    # the tree stopped this run (only meaningful while it is stopped with its parent's join open).
    ancestors: list[str] = field(default_factory=list)
    parent_tool: str = ""
    parent_chars: int = 0
    held: str = ""

    @property
    def current_turn(self) -> int:
        """The turn a live job must carry: between save points A and B it is the turn just counted."""
        return self.turns - 1 if self.phase == "tools" else self.turns


def new_header(agent: str, limits: Mapping[str, Any], now: float, queue: str = "default") -> dict[str, Any]:
    header: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "agent": agent,
        "queue": queue,
        "status": "queued",
        "turns": 0,
        "phase": "model",
        "pending": b"",
        "fence": 0,
        "attempt": 0,
        "model_errors": 0,
        "cost_usd": 0,
        "limits": pack(dict(limits)),
        "window": 0,
        "error": "",
        "result": "",
        "created_at": int(now * 1000),
        "updated_at": int(now * 1000),
    }
    header.update({name: 0 for name in USAGE_FIELDS})
    return header


def seal_value(value: Any) -> dict[str, Any]:
    """``{"plain": value}``, or ``{"sealed": token}`` when encryption at rest is on."""
    cipher = crypto.active()
    return {"sealed": cipher.seal(pack(value))} if cipher else {"plain": value}


def open_value(record: Any, what: str) -> Any:
    """The value ``seal_value`` stored. Anything else (a record damaged, or written by hand) is an
    UnreadableRecord naming ``what``: a raw TypeError or KeyError here would take down every reader
    that meets the record (a listing of the whole pool, for one bad run)."""
    if isinstance(record, dict) and "sealed" in record:
        return unpack(crypto.open_sealed(record["sealed"], what), what)
    if not isinstance(record, dict) or "plain" not in record:
        raise UnreadableRecord(f"{what} is not a stored value (neither plain nor sealed)")
    return record["plain"]


def _check_block(block: Any, where: str) -> None:
    """A content block must be a dict with a ``type``; a tool_use must name its id and tool, which the
    ledger, approvals and ``show`` key on."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise UnreadableRecord(f"{where} holds a content block that is not one: {str(block)[:60]!r}")
    if block["type"] == "tool_use" and not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
        raise UnreadableRecord(f"{where} holds a tool_use without an id or a tool name")


def tool_uses(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool_use blocks of a conversation's assistant messages, in the order the model asked for them."""
    return [
        block
        for message in messages
        if message["role"] == "assistant" and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_use"
    ]


def pack_message(message: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> bytes:
    """``meta`` keeps what else the API returned with an assistant message (id, model, stop reason,
    usage) beside it; it is never sent back."""
    record: dict[str, Any] = {"v": SCHEMA_VERSION, "role": message["role"]}
    cipher = crypto.active()
    if cipher:
        record["sealed"] = cipher.seal(pack(message["content"]))
    else:
        record["content"] = message["content"]
    if meta:
        record["meta"] = dict(meta)
    return pack(record)


def unpack_message(blob: bytes, index: int) -> dict[str, Any]:
    record = unpack(blob, f"message {index}")
    if not isinstance(record, dict) or "role" not in record or not ("content" in record or "sealed" in record):
        raise UnreadableRecord(f"message {index} is not a message record")
    version = record.get("v")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise SchemaTooNew(
            f"message {index} has schema version {version!r}; this agentpool reads up to {SCHEMA_VERSION}"
        )
    if "sealed" in record:
        content = unpack(crypto.open_sealed(record["sealed"], f"message {index}"), f"message {index}")
    else:
        content = record["content"]
    # The API's shapes: a text, or a list of blocks. Checked here, once, so that everything that reads
    # a conversation (a turn, ``show``, the dashboard) can rely on them.
    if not isinstance(record["role"], str) or not isinstance(content, (str, list)):
        raise UnreadableRecord(f"message {index} has the wrong shape (its content is {type(content).__name__})")
    if isinstance(content, list):
        for block in content:
            _check_block(block, f"message {index}")
    return {"role": record["role"], "content": content}


def message_meta(blob: bytes, index: int) -> dict[str, Any]:
    """What was kept beside a message (an assistant reply's id, stop reason, usage; a summary's origin)."""
    record = unpack(blob, f"message {index}")
    meta = record.get("meta") if isinstance(record, dict) else None
    if not isinstance(meta, dict):
        return {}
    # What a turn computes with (the compaction trigger, the next call's reservation): a damaged one is
    # an unreadable record, said once, not an error at every retry of the turn.
    tokens = meta.get("context_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        raise UnreadableRecord(f"message {index} has a context_tokens that is not a count: {str(tokens)[:40]!r}")
    return meta


def pack_pending(pending: list[dict[str, Any]]) -> bytes:
    # Tool inputs are what the model said: sealed like the messages.
    return pack(seal_value(pending)) if pending else b""


def unpack_pending(blob: bytes, run_id: str, open_sealed: bool = True) -> list[dict[str, Any]]:
    record = unpack(blob, f"run {run_id} pending tool_uses")
    if isinstance(record, dict) and "sealed" in record and not open_sealed:
        return []
    # A v1 header stored the bare list.
    pending = record if isinstance(record, list) else open_value(record, f"run {run_id} pending tool_uses")
    if not isinstance(pending, list):
        raise UnreadableRecord(f"run {run_id}: pending tool_uses have the wrong shape")
    for call in pending:
        # Each is a tool_use the model asked for: its id, tool name and input are what the turn runs
        # (the input as the model gave it, maybe None for a call cut short: its presence is checked).
        if not isinstance(call, dict) or "input" not in call:
            raise UnreadableRecord(f"run {run_id}: a pending tool_use has the wrong shape")
        _check_block({"type": "tool_use", **call}, f"run {run_id} pending tool_uses")
    return pending


RESULT_SEALED_PREFIX = "sealed:"


def pack_result(text: str) -> str:
    text = safe_text(text)  # the model's own text: it may end in half an emoji
    cipher = crypto.active()
    return RESULT_SEALED_PREFIX + cipher.seal(text.encode()).decode() if cipher and text else text


def unpack_result(text: str, run_id: str, open_sealed: bool = True) -> str:
    if text.startswith(RESULT_SEALED_PREFIX):
        if not open_sealed:
            return ""
        return crypto.open_sealed(text[len(RESULT_SEALED_PREFIX) :].encode(), f"run {run_id} result").decode()
    return text


def _text(raw: Mapping[bytes, bytes], name: str) -> str:
    return raw.get(name.encode(), b"").decode("utf-8", errors="replace")


def _number(raw: Mapping[bytes, bytes], name: str, kind: type[int | float]) -> Any:
    value = raw.get(name.encode(), b"0")
    try:
        return kind(value)
    except ValueError:
        raise UnreadableRecord(f"header field {name!r} is not a number: {value[:40]!r}") from None


def _int(raw: Mapping[bytes, bytes], name: str) -> int:
    return int(_number(raw, name, int))


def _float(raw: Mapping[bytes, bytes], name: str) -> float:
    return float(_number(raw, name, float))


def _seconds(raw: Mapping[bytes, bytes], name: str) -> float:
    """Times are stored in milliseconds (Lua has no float-friendly clock); the API speaks seconds."""
    return _int(raw, name) / 1000


def header_version(raw: Mapping[bytes, bytes]) -> int:
    return _int(raw, "v")


def load_header(run_id: str, raw: Mapping[bytes, bytes], *, open_sealed: bool = True) -> RunState:
    """Decode a header hash, upgrading older schema versions in memory. Without ``open_sealed`` the
    fields that may be encrypted (pending tool inputs, the result) are left empty when they are, so a
    listing works without the key.

    Raises SchemaTooNew for a record from a newer agentpool and UnreadableRecord for anything else
    that does not decode; neither touches the record.
    """
    version = header_version(raw)
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(
            f"run {run_id} was written with schema version {version}; this agentpool understands up to "
            f"{SCHEMA_VERSION}. Upgrade the workers; the run is left untouched."
        )
    fields = {k.decode(): v for k, v in raw.items()}
    while version < SCHEMA_VERSION:
        migrate = MIGRATIONS.get(version)
        if migrate is None:
            raise UnreadableRecord(f"run {run_id} has schema version {version}, which no migration upgrades")
        fields = migrate(fields)
        version = int(fields["v"])
    raw = {k.encode(): (v if isinstance(v, bytes) else str(v).encode()) for k, v in fields.items()}
    pending_blob = raw.get(b"pending", b"")
    pending = unpack_pending(pending_blob, run_id, open_sealed) if pending_blob else []
    limits = unpack(raw.get(b"limits", b""), "run limits") if raw.get(b"limits") else {}
    if not isinstance(limits, dict):
        raise UnreadableRecord(f"run {run_id}: limits have the wrong shape")
    status = _text(raw, "status")
    if status not in STATUSES:
        raise UnreadableRecord(f"run {run_id}: unknown status {status!r}")
    own_usage = {name: _int(raw, name) for name in USAGE_FIELDS}
    own_cost = _float(raw, "cost_usd")
    return RunState(
        id=run_id,
        agent=_text(raw, "agent"),
        status=status,
        turns=_int(raw, "turns"),
        phase=_text(raw, "phase"),
        pending=pending,
        usage={name: own_usage[name] + _int(raw, f"tree_{name}") for name in USAGE_FIELDS},
        limits=limits,
        error=_text(raw, "error"),
        result=unpack_result(_text(raw, "result"), run_id, open_sealed),
        created_at=_seconds(raw, "created_at"),
        updated_at=_seconds(raw, "updated_at"),
        model_errors=_int(raw, "model_errors"),
        cost_usd=own_cost + _float(raw, "tree_cost_usd"),
        version=version,
        window_hint=_int(raw, "window"),
        forked_from=_text(raw, "forked_from"),
        forked_at=_int(raw, "forked_at"),
        queue=_text(raw, "queue") or "default",
        concurrency_key=_text(raw, "ckey"),
        max_concurrency=_int(raw, "cmax"),
        parent=_text(raw, "parent"),
        parent_call=_text(raw, "parent_call"),
        depth=_int(raw, "depth"),
        own_usage=own_usage,
        own_cost_usd=own_cost,
        # A child made before ancestors were recorded has its parent alone (joined, not rolled up live).
        ancestors=_text(raw, "ancestors").split() or ([_text(raw, "parent")] if raw.get(b"parent") else []),
        parent_tool=_text(raw, "parent_tool"),
        parent_chars=_int(raw, "parent_chars"),
        held=_text(raw, "held"),
    )
