"""Fair shares: at most N turns of a concurrency key in flight across the pool (``store/lua/slot_acquire.lua``,
``slot_release.lua``). A turn takes a slot once it holds its run's lease and gives it back when it ends;
a slot whose run holds no lease any more (a dead worker) is free again. A turn that finds none waits in
line, holding nothing (its turn is deferred), and the turn that frees a slot wakes the first in line.

Why not RQ 3's ``RateLimit``: it cannot join a caller's transaction ("rate-limited jobs cannot be enqueued
with a pipeline"), and every turn of agentpool is enqueued inside the fenced transaction of the save
point that makes it; it holds a slot from enqueue to job end (a queued turn holds one too), frees a
killed worker's slot only in RQ's maintenance (every 10 minutes), and stores the limit from each
enqueue's own argument, so an operator's setting cannot win.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis
from redis.client import Pipeline

from agentpool.store.keys import CONCURRENCY_KEYS, CONCURRENCY_LIMITS, TURNS_DEFERRED, ConcurrencyKeys, RunKeys
from agentpool.store.scripts import run_script

WAITER_GRACE_MS = 60_000  # a waiter whose deferral never landed keeps its place this long


@dataclass(frozen=True)
class Slot:
    granted: bool
    held: int  # turns of the key in flight (with this one, when granted)
    ahead: int  # waiters ahead of this run: the live ones it read, and those it did not need to read
    limited: bool = True


def acquire(r: Redis, key: str, run_id: str, max_concurrency: int, token: str) -> Slot:
    """A slot for the turn that holds the run's lease ``token``, or its place in line."""
    keys = ConcurrencyKeys.of(key)
    holders = [m.decode() for m in r.zrange(keys.slots, 0, -1)]
    code, held, ahead = run_script(  # type: ignore[misc]
        "slot_acquire",
        r,
        [keys.slots, keys.waiting, keys.wake, CONCURRENCY_LIMITS, CONCURRENCY_KEYS]
        + [RunKeys.of(h.partition("|")[0]).lease for h in holders],
        [key, run_id, int(max_concurrency or 0), WAITER_GRACE_MS, token, *holders],
    )
    if int(code) == 2:
        return Slot(True, 0, 0, limited=False)
    return Slot(int(code) == 1, int(held), int(ahead))


def release(r: Redis, key: str, run_id: str, token: str) -> bool:
    """Free the slot of the run's turn that held ``token``, waking the first waiter. True if one was woken."""
    return bool(_release(r, key, f"{run_id}|{token}", 0))


def wake_if_free(r: Redis, key: str, max_concurrency: int) -> bool:
    """Wake the first waiter if fewer than the key's limit are held: a turn's check once its wait is
    recorded (a slot freed between its acquire and that record woke nobody). True if one was woken."""
    return bool(_release(r, key, "", max_concurrency))


def leave_line(r: Redis, key: str, run_id: str) -> None:
    """A run that will not take its place (cancelled): out of the key's line, so that nobody counts it
    as ahead, and no wake-up goes to it."""
    keys = ConcurrencyKeys.of(key)
    with r.pipeline(transaction=True) as pipe:
        pipe.zrem(keys.waiting, run_id)
        pipe.hdel(keys.wake, run_id)
        pipe.execute()


def _release(r: Redis, key: str, slot: str, max_concurrency: int, wake: int = 1) -> int:
    """How many waiters were woken (at most ``wake``)."""
    keys = ConcurrencyKeys.of(key)
    return int(
        run_script(  # type: ignore[arg-type]
            "slot_release",
            r,
            [keys.slots, keys.waiting, keys.wake, TURNS_DEFERRED, CONCURRENCY_LIMITS],
            [slot, key, int(max_concurrency or 0), wake],
        )
    )


def stage_wake(pipe: Pipeline, key: str, run_id: str, deferred_member: str, expires_ms: int) -> None:
    """In the transaction that defers a waiting turn: where to find it when a slot frees."""
    pipe.hset(ConcurrencyKeys.of(key).wake, run_id, f"{expires_ms}|{deferred_member}")


# Waiters an unset operator limit wakes at most: each asks again with its run's own max_concurrency
# (those that find no slot wait again); the rest are woken as slots free.
WAKE_ON_UNSET = 100


def set_limit(r: Redis, key: str, limit: int | None) -> int:
    """The operator's limit for ``key`` (None: the runs' own max_concurrency again). Turns waiting for
    the key are woken for the slots a higher limit frees at once (their deferred turns made due), not
    left until a holder ends or their poll. Returns how many were woken."""
    ConcurrencyKeys.of(key)  # a clear error for a bad key
    if limit is None:
        r.hdel(CONCURRENCY_LIMITS, key)
        return _release(r, key, "", WAKE_ON_UNSET, wake=WAKE_ON_UNSET)
    r.hset(CONCURRENCY_LIMITS, key, int(limit))
    r.sadd(CONCURRENCY_KEYS, key)
    return _release(r, key, "", int(limit), wake=int(limit))


@dataclass(frozen=True)
class KeyView:
    key: str
    operator_limit: int | None
    in_flight: int
    waiting: int


def show(r: Redis) -> list[KeyView]:
    out = []
    limits = {k.decode(): int(v) for k, v in r.hgetall(CONCURRENCY_LIMITS).items()}
    for raw in sorted(r.smembers(CONCURRENCY_KEYS)):
        key = raw.decode()
        keys = ConcurrencyKeys.of(key)
        with r.pipeline(transaction=False) as pipe:
            pipe.zcard(keys.slots)
            pipe.zcard(keys.waiting)
            in_flight, waiting = pipe.execute()
        out.append(KeyView(key, limits.get(key), int(in_flight), int(waiting)))
    return out
