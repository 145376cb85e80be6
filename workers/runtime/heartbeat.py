"""Keeps the leases of the turns running in this process alive, through long model calls and slow tools.

One thread per process renews every lease the process holds, those due together in one pipelined
round trip, each at a third of its TTL: two renewals can fail (a Redis blip) before a lease lapses.
A turn holds its lease in ``keep_alive`` for as long as it runs: a dict entry, not a thread of its
own (starting and joining one cost half a millisecond per turn, and a threaded worker runs hundreds).

A renewal races the commit that ends a turn (save point B deletes the lease): a renewal sent just
before the commit lands after it and finds no lease, while the turn is on its way out of
``keep_alive``. So one refused renewal is not news; the lease is reported lost only if the turn still
holds it a period later and the renewal is refused again. A turn that really lost its lease learns
it at its next write anyway (``LeaseLost``), which is logged where it is caught.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError

from agentpool.store import lease
from agentpool.store.keys import RunKeys

log = logging.getLogger("agentpool.heartbeat")


@dataclass(eq=False)
class _Held:
    r: Redis
    keys: RunKeys
    token: str
    ttl_ms: int
    due: float  # time.monotonic() of the next renewal
    refused: bool = False  # the last renewal found the lease gone or someone else's

    @property
    def period(self) -> float:
        return self.ttl_ms / 3000


class LeaseKeeper:
    def __init__(self) -> None:
        self._reset()
        # A forked work horse starts with none of its parent's leases and no keeper thread.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._held: set[_Held] = set()
        self._changed = threading.Event()  # a lease came due earlier than the keeper is waiting for
        self._thread: threading.Thread | None = None

    @contextmanager
    def keep_alive(self, r: Redis, keys: RunKeys, token: str, ttl_ms: int) -> Iterator[None]:
        held = _Held(r, keys, token, ttl_ms, due=time.monotonic() + ttl_ms / 3000)
        with self._lock:
            if not self._held or held.due < min(h.due for h in self._held):
                self._changed.set()
            self._held.add(held)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agentpool-leases", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._held.discard(held)

    def _run(self) -> None:
        while True:
            with self._lock:
                due = min((h.due for h in self._held), default=None)
            if self._changed.wait(None if due is None else max(0.0, due - time.monotonic())):
                self._changed.clear()
                continue
            now = time.monotonic()
            with self._lock:  # leases due within half a period go along: one round trip for all
                batch = [h for h in self._held if h.due - h.period / 2 <= now]
                for held in batch:
                    held.due = now + held.period
            self._renew(batch)

    def _renew(self, batch: list[_Held]) -> None:
        for r in {id(h.r): h.r for h in batch}.values():
            mine = [h for h in batch if h.r is r]
            try:
                kept = lease.renew_many(r, [(h.keys, h.token, h.ttl_ms) for h in mine])
            except RedisError as exc:
                log.warning("could not renew %d lease(s) (%s); retrying", len(mine), exc)
                continue
            for held, ok in zip(mine, kept):
                if ok:
                    held.refused = False
                    continue
                with self._lock:
                    if held not in self._held:
                        continue  # the turn ended (its commit deleted the lease) while we renewed
                    if not held.refused:
                        held.refused = True  # maybe that commit, its turn about to leave: ask again
                        continue
                    self._held.discard(held)
                log.warning("run %s: lease lost; this turn will commit nothing further", held.keys.run_id)


keeper = LeaseKeeper()
keep_alive = keeper.keep_alive
