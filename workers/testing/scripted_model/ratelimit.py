"""Rate limits as the Messages API enforces them: a token bucket per minute for requests, input tokens
and output tokens, the ``anthropic-ratelimit-*`` headers on every reply, and a 429 ``rate_limit_error``
with ``retry-after`` beyond them.

What the API documents (docs.claude.com, "Rate limits"), and what this copies:

- Each bucket holds up to its per-minute limit and refills continuously (not reset once a minute).
- Input tokens per minute count ``input_tokens + cache_creation_input_tokens``; on current models
  ``cache_read_input_tokens`` do not count (that is what makes caching raise throughput).
- Output tokens per minute are estimated from the request's ``max_tokens`` when it is admitted and
  corrected to the tokens really produced when it ends, so a large ``max_tokens`` alone can be refused.
- Headers: ``anthropic-ratelimit-{requests,input-tokens,output-tokens}-{limit,remaining,reset}``, and
  ``anthropic-ratelimit-tokens-*`` for the most restrictive of the input and output ones; ``reset`` is an
  RFC 3339 time at which the bucket is full again. A 429 carries ``retry-after`` in whole seconds.

Only limits that are set are enforced and reported: a scripted model without limits sends none of these
headers. ``minute`` (seconds) scales time for tests and the bench: ``RateLimits(rpm=600, minute=6)``
admits 600 requests per 6 s, and its resets and ``retry-after`` are in those scaled seconds.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from dataclasses import dataclass

from agentpool.testing.scripted_model.common import ApiError

DIMENSIONS = ("requests", "input-tokens", "output-tokens")


@dataclass(frozen=True)
class RateLimits:
    rpm: int | None = None  # requests per minute
    itpm: int | None = None  # input tokens per minute (uncached input and cache writes)
    otpm: int | None = None  # output tokens per minute
    minute: float = 60.0  # how many seconds a "minute" lasts here (scaled down for tests)

    def __post_init__(self) -> None:
        for name in ("rpm", "itpm", "otpm"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"RateLimits.{name} must be a positive integer or None, got {value!r}")
        if not (isinstance(self.minute, (int, float)) and math.isfinite(self.minute) and self.minute > 0):
            raise ValueError(f"RateLimits.minute must be a positive number of seconds, got {self.minute!r}")

    def by_dimension(self) -> dict[str, int]:
        limits = {"requests": self.rpm, "input-tokens": self.itpm, "output-tokens": self.otpm}
        return {name: value for name, value in limits.items() if value is not None}


class _Bucket:
    def __init__(self, capacity: int, minute: float) -> None:
        self.capacity = capacity
        self.rate = capacity / minute  # per second
        self.level = float(capacity)
        self.at = time.monotonic()

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is in the bucket (refilled to ``now``)."""
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)

    def full_in(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)


def rfc3339(seconds_from_now: float) -> str:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds_from_now)
    return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


class Admission:
    """One admitted request: its output estimate is corrected with ``settle`` when the reply is known."""

    def __init__(self, limiter: RateLimiter, output_estimate: int) -> None:
        self.limiter, self.output_estimate = limiter, output_estimate
        self.headers: dict[str, str] = {}

    def settle(self, output_tokens: int) -> None:
        self.limiter._give_back("output-tokens", self.output_estimate - output_tokens)


class RateLimiter:
    """The buckets of one scripted model; thread-safe."""

    def __init__(self, limits: RateLimits | None = None) -> None:
        self._lock = threading.Lock()
        self.configure(limits)

    def configure(self, limits: RateLimits | None) -> None:
        """New limits (None: none), with full buckets."""
        with self._lock:
            self.limits = limits or RateLimits()
            self._buckets = {name: _Bucket(cap, self.limits.minute) for name, cap in self.limits.by_dimension().items()}
            self.refused = 0
            self.admitted = {name: 0 for name in DIMENSIONS}  # what the buckets were charged, corrections in

    def refill(self) -> None:
        self.configure(self.limits)

    def admit(self, input_tokens: int, max_tokens: int) -> Admission:
        """Take one request, its input tokens (those that count) and ``max_tokens`` from the buckets, or
        raise the API's 429. The returned admission carries the headers of the reply."""
        need = {"requests": 1, "input-tokens": input_tokens, "output-tokens": max_tokens}
        with self._lock:
            now = time.monotonic()
            for bucket in self._buckets.values():
                bucket.refill(now)
            short = [name for name, bucket in self._buckets.items() if bucket.level < min(need[name], bucket.capacity)]
            if short:
                self.refused += 1
                wait = max(self._buckets[name].wait_for(need[name]) for name in short)
                headers = self._headers()
                headers["retry-after"] = str(max(1, math.ceil(wait)))
                what = " and ".join(short).replace("-", " ")
                raise ApiError(
                    429,
                    "rate_limit_error",
                    f"This request would exceed the rate limit for your organization of {what} per minute. "
                    "Please reduce the prompt length or the maximum tokens requested, or try again later.",
                    headers,
                )
            for name, bucket in self._buckets.items():
                bucket.level -= need[name]
            for name in DIMENSIONS:
                self.admitted[name] += need[name]
            admission = Admission(self, max_tokens)
            admission.headers = self._headers()
            return admission

    def totals(self) -> dict[str, int]:
        """Requests and counted tokens admitted since the limits were set, and requests refused."""
        with self._lock:
            return {**self.admitted, "refused": self.refused}

    def _give_back(self, name: str, amount: float) -> None:
        with self._lock:
            self.admitted[name] -= int(amount)
            bucket = self._buckets.get(name)
            if bucket is not None:
                bucket.refill(time.monotonic())
                bucket.level = min(bucket.capacity, bucket.level + amount)

    def _headers(self) -> dict[str, str]:
        """The ``anthropic-ratelimit-*`` headers as the buckets stand (caller holds the lock)."""
        headers: dict[str, str] = {}
        for name, bucket in self._buckets.items():
            headers[f"anthropic-ratelimit-{name}-limit"] = str(bucket.capacity)
            headers[f"anthropic-ratelimit-{name}-remaining"] = str(max(0, int(bucket.level)))
            headers[f"anthropic-ratelimit-{name}-reset"] = rfc3339(bucket.full_in())
        tokens = [self._buckets[n] for n in ("input-tokens", "output-tokens") if n in self._buckets]
        if tokens:
            # The most restrictive token limit in effect: the one with the least left.
            tightest = min(tokens, key=lambda b: b.level / b.capacity)
            headers["anthropic-ratelimit-tokens-limit"] = str(tightest.capacity)
            headers["anthropic-ratelimit-tokens-remaining"] = str(max(0, int(tightest.level)))
            headers["anthropic-ratelimit-tokens-reset"] = rfc3339(tightest.full_in())
        return headers
