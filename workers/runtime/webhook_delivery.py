"""The webhook delivery thread every worker runs: it POSTs the deliveries that status changes recorded.

Every second it looks for due deliveries (``ap:webhooks:due``), claims one at a time with a lease
(``agentpool.store.webhooks.claim``), POSTs the run's summary signed with ``AGENTPOOL_WEBHOOK_SECRET``
(``agentpool.webhooks``), and records the outcome: delivered on a 2xx, else due again after an
exponential backoff with jitter, until the delivery is ``AGENTPOOL_WEBHOOK_MAX_AGE`` old (a day): then
undelivered, with the last error, which ``agentpool show`` and the dashboard show.

It runs beside the turns, never inside one and never inside a model call: a slow or dead receiver
delays other deliveries, never a turn. One attempt is bounded by ``AGENTPOOL_WEBHOOK_TIMEOUT`` per
socket operation (connect, send, the status line); the claim's lease covers three of them and a margin,
so a worker killed while delivering leaves the delivery due again for any worker then. Redirects are
not followed (a 3xx is a failure); nothing but the run's summary is sent (no key, no Redis URL), and
logs name the receiver without its credentials or query.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from agentpool import webhooks
from agentpool.runtime.faults import fault
from agentpool.runtime.settings import Settings
from agentpool.store import crypto
from agentpool.store import webhooks as deliveries
from agentpool.store.clock import now_ms

log = logging.getLogger("agentpool.webhooks")
POLL = 1.0  # seconds between looks for due deliveries, when the last look found none to spare
BATCH = 20  # due deliveries looked at per look
FIRST_BACKOFF = 1.0  # seconds before the first retry; doubled each attempt, jittered, up to MAX_BACKOFF
MAX_BACKOFF = 600.0
LEFT_FOR_OTHERS = 30.0  # seconds this worker leaves alone a delivery it cannot make (another worker can)
USER_AGENT = "agentpool-webhooks/1"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError with the 3xx: a failure, retried like any other


_opener = urllib.request.build_opener(_NoRedirects)


def backoff(attempt: int) -> float:
    """Seconds before the next try after failed attempt ``attempt`` (1, 2, ...): exponential, capped,
    with jitter so that the deliveries of a receiver that was down do not all come back at once."""
    return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** min(attempt - 1, 30)) * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class Failure:
    """What went wrong, in one line (no URL: it may carry a token), and the start of the receiver's
    answer. Only ``what`` is recorded with the run, where whoever may read the run reads it: an answer's
    body, read back from wherever the run's webhook pointed (an internal service, say), goes to the
    worker's log only."""

    what: str
    answer: str = ""

    def for_log(self) -> str:
        return f"{self.what}: {self.answer}" if self.answer else self.what


def post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> Failure | None:
    """POST ``body``; None on a 2xx, else the :class:`Failure`."""
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with _opener.open(request, timeout=timeout) as answer:
            answer.read(1024)
            status = answer.status
    except urllib.error.HTTPError as exc:
        status = exc.code
        redirect = " (redirects are not followed)" if 300 <= status < 400 else ""
        return Failure(f"HTTP {status}{redirect}", _snippet(exc))
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, socket.timeout | TimeoutError):
            return Failure(f"no answer within {timeout:g} s")
        return Failure(f"cannot connect: {reason}")
    except TimeoutError:
        return Failure(f"no answer within {timeout:g} s")
    except OSError as exc:
        return Failure(f"connection failed: {exc}")
    return None if 200 <= status < 300 else Failure(f"HTTP {status}")


def _snippet(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read(300).decode("utf-8", errors="replace")
    except Exception:  # noqa: BLE001 - the status alone says enough
        return ""
    return " ".join(text.split())[:200]


class WebhookDelivery:
    """Delivers due webhooks from one process; ``run_once`` is one look (the thread loops on it)."""

    def __init__(self, r: Redis, settings: Settings, worker: str) -> None:
        self.r, self.settings, self.worker = r, settings, worker
        # A worker that cannot make a delivery (no secret, no default) looks at it again only now and then.
        self._left: dict[str, float] = {}
        self.lease_ms = int((3 * settings.webhook_timeout + 5) * 1000)

    def run_once(self, stopping: threading.Event | None = None) -> int:
        """Claim and make the due deliveries this worker can; returns how many were attempted."""
        now = time.monotonic()
        ids = [i for i in deliveries.due(self.r, limit=BATCH) if self._left.get(i, 0) <= now]
        random.shuffle(ids)  # workers looking at once do not all race for the same first one
        attempted = 0
        for delivery_id in ids:
            if stopping is not None and stopping.is_set():
                break
            try:
                claimed = deliveries.claim(
                    self.r,
                    delivery_id,
                    lease_ms=self.lease_ms,
                    secret=bool(self.settings.webhook_secret),
                    default=bool(self.settings.webhook_url),
                )
            except ValueError:  # not a delivery id agentpool wrote
                log.warning("webhooks: %r in the due set is not a delivery id; left alone", delivery_id)
                self._left[delivery_id] = now + 3600
                continue
            if claimed == deliveries.LEFT:
                self._leave(delivery_id, now)
            elif isinstance(claimed, deliveries.Claim):
                self.attempt(claimed)
                attempted += 1
        if len(self._left) > 10_000:
            self._left = {i: t for i, t in self._left.items() if t > now}
        return attempted

    def _leave(self, delivery_id: str, now: float) -> None:
        if delivery_id not in self._left:
            missing = "AGENTPOOL_WEBHOOK_SECRET" if not self.settings.webhook_secret else "AGENTPOOL_WEBHOOK_URL"
            log.warning(
                "webhook delivery %s waits for a worker with %s (this worker %s has none)",
                delivery_id,
                missing,
                self.worker,
            )
        self._left[delivery_id] = now + LEFT_FOR_OTHERS

    def attempt(self, claim: deliveries.Claim) -> None:
        """One attempt at a claimed delivery, and its outcome recorded."""
        url = claim.summary.get("url") or self.settings.webhook_url
        body = webhooks.encode(
            webhooks.body_of(
                claim.delivery_id, claim.run_id, claim.summary, claim.result, with_result=crypto.active() is None
            )
        )
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            webhooks.DELIVERY_HEADER: claim.delivery_id,
            webhooks.SIGNATURE_HEADER: webhooks.sign(body, self.settings.webhook_secret),
        }
        failure = post(url, body, headers, self.settings.webhook_timeout)
        where = webhooks.shown_url(url)
        if failure is None:
            fault("after_webhook_answered", claim.run_id, claim.n)
            deliveries.done(self.r, claim, "delivered")
            log.info(
                "run %s: webhook %s delivered to %s (attempt %d)", claim.run_id, claim.delivery_id, where, claim.attempt
            )
            return
        recorded_at = int(claim.summary.get("at") or now_ms())
        give_up_at = recorded_at + int(self.settings.webhook_max_age * 1000)
        now = now_ms()
        if now >= give_up_at:
            deliveries.done(self.r, claim, "undelivered", error=failure.what)
            log.error(
                "run %s: webhook %s to %s undelivered after %d attempts over %.0f s; last: %s",
                claim.run_id,
                claim.delivery_id,
                where,
                claim.attempt,
                (now - recorded_at) / 1000,
                failure.for_log(),
            )
            return
        retry_at = min(now + int(backoff(claim.attempt) * 1000), give_up_at)
        deliveries.done(self.r, claim, "retry", error=failure.what, retry_at_ms=retry_at)
        log.warning(
            "run %s: webhook %s to %s failed (attempt %d: %s); next try in %.1f s",
            claim.run_id,
            claim.delivery_id,
            where,
            claim.attempt,
            failure.for_log(),
            (retry_at - now) / 1000,
        )


class WebhookThread(threading.Thread):
    """``WebhookDelivery.run_once`` every ``POLL`` seconds (at once again while it finds work)."""

    def __init__(self, r: Redis, worker: str, settings: Settings | None = None) -> None:
        super().__init__(name="agentpool-webhooks", daemon=True)
        settings = settings or Settings.from_env()
        settings.check_worker()
        self.delivery = WebhookDelivery(r, settings, worker)
        self.stopping = threading.Event()

    def run(self) -> None:
        pause = POLL
        while not self.stopping.wait(pause * random.uniform(0.8, 1.2)):
            try:
                pause = 0.0 if self.delivery.run_once(self.stopping) >= BATCH else POLL
            except RedisError as exc:
                log.warning("webhooks: Redis unavailable (%s); will retry", exc)
                pause = POLL
            except Exception:
                log.exception("webhooks: unexpected error")
                pause = POLL

    def stop(self) -> None:
        self.stopping.set()
