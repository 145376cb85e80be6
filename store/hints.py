"""What a worker process learnt of Redis that holds for a moment, so that its turns need not ask again:
"no run of the pool is watched" (``agentpool.store.live``), "this model is unlimited and its replies
carry no rate-limit headers" (``agentpool.store.ratelimit``). Each hint is kept per connection pool (a
shard's answer is its own) until a monotonic time. A forking worker's work horse hands its hints to its
worker as it ends (``export``, ``adopt``), whose next horse inherits them: ``time.monotonic`` is the
system's, the same in both processes, and a pool object keeps its id across the fork."""

from __future__ import annotations

import time
from collections.abc import Mapping

from redis import Redis


def pool_key(r: Redis, *parts: str) -> str:
    """A hint's key: ``r``'s connection pool, then ``parts`` (none of which holds a "|")."""
    return "|".join([str(id(r.connection_pool)), *parts])


class Hints:
    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def holds(self, key: str) -> bool:
        return self._until.get(key, 0.0) > time.monotonic()

    def remember(self, key: str, seconds: float) -> None:
        self._until[key] = time.monotonic() + seconds

    def forget(self, key: str) -> None:
        self._until.pop(key, None)

    def export(self) -> dict[str, float]:
        return dict(self._until)

    def adopt(self, hints: Mapping[str, float]) -> None:
        for key, until in hints.items():
            self._until[str(key)] = max(self._until.get(str(key), 0.0), float(until))

    def clear(self) -> None:
        self._until.clear()
