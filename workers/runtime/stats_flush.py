"""A worker process's pool-wide counters, flushed into Redis about once a second.

A turn's events carry a dozen counters (turns, tokens by kind, cost, latency buckets, tool calls...);
added inside each write they were a dozen Redis commands a turn. A worker process adds them up itself
instead (``agentpool.store.stats``) and this thread adds the sums to ``ap:stats`` in one script call a
second: ``/metrics`` lags by up to a second, and a process killed outright (SIGKILL, OOM) loses what it
counted in its last second. A warm stop flushes what is left.

A forking worker's work horses are forked for one turn each and never run this thread: a horse hands
what it counted to its worker through a pipe as it ends (``agentpool.worker.forking``).
"""

from __future__ import annotations

import logging
import threading

from redis import Redis
from redis.exceptions import RedisError

from agentpool.store import stats

log = logging.getLogger("agentpool.stats")
FLUSH_EVERY = 1.0  # seconds


class StatsFlusher(threading.Thread):
    def __init__(self, r: Redis, interval: float = FLUSH_EVERY) -> None:
        super().__init__(name="agentpool-stats", daemon=True)
        self.r, self.interval = r, interval
        self.tally = stats.accumulate()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self._flush()

    def _flush(self) -> None:
        try:
            self.tally.flush(self.r)
        except RedisError as exc:  # kept, and sent again as it was by the next flush
            log.warning("stats: could not flush the counters (%s); will retry", exc)
        except Exception:
            log.exception("stats: unexpected error flushing the counters")

    def stop(self) -> None:
        """The last flush, on a warm stop."""
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)
        self._flush()
