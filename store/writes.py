"""Writes safe to deliver twice.

The client retries a command whose connection dropped (``agentpool.runtime.settings.connect``:
``retry_on_error=[ConnectionError, TimeoutError]``), and redis-py re-sends a command, an EVALSHA or an
unwatched MULTI/EXEC whose *reply* was lost although Redis had applied it. Every write agentpool makes
is therefore one of:

- idempotent by nature: applying it twice leaves what applying it once does (a compare-and-delete
  release, a lease renewal, an HSET of a ledger record that is already there, byte for byte);
- a script carrying a **write id** (``new_id()``): the script records the id with its result in the
  run's ``writes`` field (``store/lua/_once.lua``) and a re-delivery returns the first result without
  doing anything again (save point A with its spend, a cut stream's spend, ``finish``, events, the
  hand-back, a lease acquire recognises its own request);
- a WATCH/MULTI transaction: redis-py never re-sends those (a dropped connection while watching
  raises ``WatchError``), so the transaction records its write id (``stage_remember``) and the
  caller's retry loop first asks whether it landed (``landed``) before deciding again; ``watched``
  is that loop.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import WatchError

from agentpool.store.scripts import compact_source

T = TypeVar("T")

FIELD = "writes"  # in a run's header (the lease holder's writes), and in its hand-back record
# Everybody else's writes to a run's header (an app's, the reaper's, events): a ring of their own, so a
# burst of them never pushes out the id of a save point whose re-send is on its way (_once.lua).
OTHERS = "writes_others"


def new_id() -> str:
    """One per logical write, made before the first delivery and re-sent unchanged."""
    return secrets.token_hex(6)


def landed(recent: bytes | None, write_id: str) -> str | None:
    """The result a write with ``write_id`` recorded, if it landed; ``recent`` is the ``writes`` field."""
    if not recent:
        return None
    for entry in recent.decode("ascii", errors="replace").split(";"):
        name, _, result = entry.partition("=")
        if name == write_id:
            return result
    return None


def ring_of_one(write_id: str, result: str = "1") -> str:
    """The ring ``remember`` leaves in a field that was empty (``_once.lua``'s ``ring_with``): for a
    transaction that creates the hash under WATCH, and so writes the field with its own HSET instead of
    a script."""
    return f"{write_id}={result};"


def stage_remember(pipe: Any, key: str, write_id: str, result: str = "1", *, field: str = OTHERS) -> None:
    """Inside MULTI: record ``write_id`` in ``key``'s ``field`` with the rest of the transaction: by
    default the ring of writes not made by the lease holder, which ``FIELD`` is for."""
    pipe.eval(compact_source("remember_write"), 1, key, write_id, result, field)


def watched(r: Redis, keys: Sequence[str], attempt: Callable[[Pipeline, str], T]) -> T:
    """``attempt(pipe, write_id)`` under WATCH of ``keys``, tried again on ``WatchError`` (a watched key
    changed, or the connection dropped after EXEC was sent) with the same write id, so a try first asks
    ``landed`` whether an earlier one went through. ``attempt`` reads, then returns without writing
    (``pipe.unwatch()``) or calls ``pipe.multi()``, stages its writes (with ``stage_remember``, unless
    they are safe to apply twice by nature) and ``pipe.execute()``."""
    write_id = new_id()
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(*keys)
                return attempt(pipe, write_id)
            except WatchError:
                continue
