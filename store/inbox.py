"""Messages sent to a run (``send_message``): its inbox, and where each was delivered.

A message to a run that is queued, running or waiting for a person waits in the run's ``inbox`` list
(its id) and ``received`` hash (its content, sealed like the conversation when encryption at rest is
on). The turn's save point B takes every waiting message into the user message that carries the turn's
tool_results (tool_result blocks first, then the messages in the order they were sent) and marks each
delivered, in the same EXEC: a crash delivers a message once or not yet, never twice. A reply that
would complete the run while messages wait is committed as a turn that goes on instead (save point A
refuses to complete), so its save point B delivers them. A run that stopped with messages still waiting
(a limit checked at a turn's start ends the run as it is) gets them in the write that restarts it
(``send_message``, ``resume``), before the model call it goes on with. An id whose content is missing
(a damaged record) leaves the inbox with the messages delivered around it, named in the event as lost.
A fork of the run's whole committed conversation (``fork_run``) gets a copy of the messages waiting,
delivered in it at once; the run keeps its inbox as it was.

``received`` keeps every message after delivery too: a retried ``send_message`` with the same id finds
it (delivered once), and ``wait_for_run(after_message=...)`` reads where it was delivered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.store.codec import pack, unpack
from agentpool.store.events import Event
from agentpool.store.keys import RunKeys
from agentpool.store.records import open_value, pack_message, seal_value


@dataclass(frozen=True)
class Delivery:
    """Where a message went: the run's turn count when it was delivered, and its index in the conversation."""

    turns: int
    index: int


def pack_content(content: Any) -> bytes:
    return pack(seal_value(content))


def unpack_content(blob: bytes, what: str) -> Any:
    return open_value(unpack(blob, what), what)


def as_blocks(content: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def read_waiting(pipe: Pipeline | Redis, keys: RunKeys) -> list[tuple[str, Any]]:
    """The inbox, oldest first, as ``(message_id, content)``; content is None for an id whose content is
    missing from ``received`` (never written apart, so only a damaged record: it can never be delivered,
    and delivery drops it from the inbox with the rest). Called while the caller watches ``keys.inbox``
    (immediate mode), so the list cannot change before its EXEC."""
    return with_contents(pipe, keys, [i.decode() for i in pipe.lrange(keys.inbox, 0, -1)])


def with_contents(r: Pipeline | Redis, keys: RunKeys, ids: list[str]) -> list[tuple[str, Any]]:
    """``(message_id, content)`` for each of ``ids``, content None where ``received`` lacks it. A message's
    content never changes once kept, so the ids may come from an earlier read."""
    if not ids:
        return []
    blobs = r.hmget(keys.received, ids)
    return [
        (i, unpack_content(blob, f"message {i} to run {keys.run_id}") if blob else None)
        for i, blob in zip(ids, blobs, strict=True)
    ]


def read_for_delivery(pipe: Pipeline | Redis, keys: RunKeys) -> tuple[list[tuple[str, Any]], int]:
    """``read_waiting``, and where a user message delivering them would go (the conversation's length;
    0 when nothing waits, which costs no read). Called under WATCH of ``keys.inbox``."""
    waiting = read_waiting(pipe, keys)  # one LRANGE in the common case: nothing waits
    return waiting, int(pipe.llen(keys.messages)) if waiting else 0


def merged(message: Mapping[str, Any] | None, waiting: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """The user message that closes a turn: its tool_results (``message``) first, then the waiting messages."""
    blocks = as_blocks(message["content"]) if message else []  # a text content is one text block
    for _id, content in waiting:
        if content is not None:
            blocks.extend(as_blocks(content))
    return {"role": "user", "content": blocks} if blocks else None


def stage_delivered(pipe: Pipeline, keys: RunKeys, waiting: list[tuple[str, Any]], *, turns: int, index: int) -> None:
    """In MULTI: the ``waiting`` messages (the head of the inbox, as read under WATCH: every id read, so
    the trim never leaves one of them behind to be delivered twice) leave it, the ones with content
    delivered in the message at ``index`` while the run had counted ``turns`` turns."""
    if not waiting:
        return
    pipe.ltrim(keys.inbox, len(waiting), -1)
    delivered = {f"{i}:at": f"{turns}:{index}" for i, content in waiting if content is not None}
    if delivered:
        pipe.hset(keys.received, mapping=delivered)


def stage_user_message(
    pipe: Pipeline,
    keys: RunKeys,
    message: Mapping[str, Any] | None,
    waiting: list[tuple[str, Any]],
    *,
    turns: int,
    index: int,
) -> list[str]:
    """In MULTI: the user message that closes a turn (``message``: its tool_results) or opens a resumed one
    (``message`` None), with the ``waiting`` messages (the head of the inbox, as read under WATCH) after
    any tool_result, appended at ``index``; those leave the inbox, delivered there at ``turns``, with one
    ``message_delivered`` event (which names as ``lost`` any id whose content was missing: dropped, not
    delivered). Appends nothing when both are empty. Returns the ids delivered."""
    closing = merged(message, waiting)
    if closing is not None:
        pipe.rpush(keys.messages, pack_message(closing))
    ids = [i for i, content in waiting if content is not None]
    if waiting:
        stage_delivered(pipe, keys, waiting, turns=turns, index=index)
        lost = [i for i, content in waiting if content is None]
        fields = {"lost": ",".join(lost)} if lost else {}
        Event.of(keys.run_id, "message_delivered", messages=",".join(ids), turn=turns, **fields).stage(pipe)
    return ids


def stage_received(pipe: Pipeline, keys: RunKeys, message_id: str, content: Any) -> None:
    """In MULTI: keep the message's content under its id (before it waits or is delivered)."""
    pipe.hset(keys.received, message_id, pack_content(content))


def delivery(r: Redis | Pipeline, keys: RunKeys, message_id: str) -> Delivery | None:
    raw = r.hget(keys.received, f"{message_id}:at")
    if not raw:
        return None
    turns, _, index = raw.decode().partition(":")
    return Delivery(int(turns), int(index))


def waiting(r: Redis, keys: RunKeys) -> list[dict[str, Any]]:
    """The messages still waiting for delivery: ``{"id", "content"}``, oldest first."""
    return [{"id": i, "content": content} for i, content in read_waiting(r, keys) if content is not None]
