"""Reading the pool-wide counters in a test: workers add theirs to Redis about once a second
(``agentpool.runtime.stats_flush``), so a test that checks them right after a run ends waits for the
last flush first."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agentpool.runtime.stats_flush import FLUSH_EVERY
from agentpool.store import stats


def settled_stats(
    r: Any,
    *,
    timeout: float = 120.0,
    until: Callable[[dict[str, float]], bool] | None = None,
    until_timeout: float = 30.0,
    flush_interval: float = FLUSH_EVERY,
) -> dict[str, float]:
    """The counters behind ``/metrics`` once no worker has added anything for more than two flush
    periods: call it when the runs you count have ended (and nothing else is running). ``until``: first
    wait up to ``until_timeout`` for the counters to say so (a worker's flush can come seconds late on a
    loaded machine, after a quiet spell; counts a worker lost never come, and the caller's check says so).
    ``flush_interval``: the workers' ``AGENTPOOL_FLUSH_INTERVAL`` when the test gives them one (their
    environment is not this process's)."""
    quiet = 2 * flush_interval + 0.5
    if until is not None:
        waited = time.monotonic() + until_timeout
        while not until(stats.read_all(r)) and time.monotonic() < waited:
            time.sleep(0.2)
    deadline = time.monotonic() + timeout
    seen, since = stats.read_all(r), time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pool's counters still changed after {timeout:g} s")
        time.sleep(0.1)
        now = stats.read_all(r)
        if now != seen:
            seen, since = now, time.monotonic()
    return seen
