"""A worker process's pool-wide counters, flushed into Redis about once a second.

A turn's events carry a dozen counters (turns, tokens by kind, cost, latency buckets, tool calls...);
added inside each write they were a dozen Redis commands a turn. A worker process adds them up itself
instead (``agentpool.store.stats``) and this thread adds the sums to ``ap:stats`` in one script call a
second: ``/metrics`` lags by up to a second, and a process killed outright (SIGKILL, OOM) loses what it
counted in its last second. A warm stop flushes what is left.

The same thread sends the rate-limit settles that may wait (``agentpool.store.ratelimit.DeferredSettles``):
one script call a second for all of them.

A forking worker's work horses are forked for one turn each and never run this thread: a horse hands
what it counted to its worker through a pipe at each milestone of its turn (``stats.hand_over``), and
its settles as it ends (``agentpool.worker.forking``).
"""

from __future__ import annotations

import logging
import threading

from redis import Redis
from redis.exceptions import RedisError, ResponseError

from agentpool.store import ratelimit, stats

log = logging.getLogger("agentpool.stats")
FLUSH_EVERY = 1.0  # seconds


class StatsFlusher(threading.Thread):
    def __init__(self, r: Redis, interval: float = FLUSH_EVERY) -> None:
        super().__init__(name="agentpool-stats", daemon=True)
        self.r, self.interval = r, interval
        self.tally = stats.accumulate()
        self.settles = ratelimit.defer_settles()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self._flush()

    def _flush(self) -> None:
        for what, send in (("the counters", self.tally.flush), ("the rate-limit settles", self.settles.send)):
            try:
                send(self.r)
            except ResponseError as exc:
                # The counters are kept and sent again; a batch of settles the script refused is dropped
                # (sent again, it would fail again): the budget corrects itself as it refills.
                log.error("stats: could not flush %s (%s)", what, exc)
            except RedisError as exc:  # kept, and sent again by the next flush
                log.warning("stats: could not flush %s (%s); will retry", what, exc)
            except Exception:
                log.exception("stats: unexpected error flushing %s", what)

    def stop(self) -> None:
        """The last flush, on a warm stop. A settle made after it (a turn still ending) goes with its turn."""
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)
        self.settles.close()
        self._flush()
