"""Keeps a turn's lease alive while the turn runs, through long model calls and slow tools."""

from __future__ import annotations

import logging
import threading

from redis import Redis
from redis.exceptions import RedisError

from store import lease
from store.keys import RunKeys

log = logging.getLogger("agentpool.heartbeat")


class Heartbeat:
    def __init__(self, r: Redis, keys: RunKeys, token: str, ttl_ms: int) -> None:
        self._r, self._keys, self._token, self._ttl_ms = r, keys, token, ttl_ms
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{keys.run_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        # Renew at a third of the TTL: two renewals can fail (a Redis blip) before the lease lapses.
        interval = self._ttl_ms / 3000
        while not self._stop.wait(interval):
            try:
                if not lease.renew(self._r, self._keys, self._token, self._ttl_ms):
                    log.warning("run %s: lease lost; this turn will commit nothing further", self._keys.run_id)
                    self.lost.set()
                    return
            except RedisError as exc:
                log.warning("run %s: heartbeat failed (%s); retrying", self._keys.run_id, exc)
