"""The webhook delivery thread every worker runs: it POSTs the deliveries that status changes recorded.

Every second it looks for due deliveries (``ap:webhooks:due``), claims one at a time with a lease
(``agentpool.store.webhooks.claim``), POSTs the run's summary signed with ``AGENTPOOL_WEBHOOK_SECRET``
(``agentpool.webhooks``), and records the outcome: delivered on a 2xx, else due again after an
exponential backoff with jitter, until the delivery is ``AGENTPOOL_WEBHOOK_MAX_AGE`` old (a day): then
undelivered, with the last error, which ``agentpool show`` and the dashboard show.

It runs beside the turns, never inside one and never inside a model call: a slow or dead receiver
delays other deliveries, never a turn. One attempt as a whole (DNS, connect, TLS, send, the answer's
status line and headers) is bounded by ``AGENTPOOL_WEBHOOK_TIMEOUT``, not each socket read: a receiver
trickling its answer cannot hold the thread, and every attempt ends well inside the claim's lease
(three timeouts and a margin), so no other worker takes over a delivery still being made. A worker
killed while delivering leaves the delivery due again for any worker when the lease ends. Redirects
are not followed (a 3xx is a failure); with ``AGENTPOOL_WEBHOOK_NETWORKS=public`` only public addresses
are connected to (``agentpool.runtime.egress``: a refused delivery is given up at once, unsent); nothing
but the run's summary is sent (no key, no Redis URL);
logs name the receiver by scheme, host and port only; the run records only that an attempt failed
(``FAILED``), the reason goes to the log.
"""

from __future__ import annotations

import http.client
import io
import logging
import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import Redis
from redis.exceptions import RedisError

from agentpool import webhooks
from agentpool.runtime.egress import AddressRefused, Networks
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
ANY = Networks()  # AGENTPOOL_WEBHOOK_NETWORKS unset: any address


def backoff(attempt: int) -> float:
    """Seconds before the next try after failed attempt ``attempt`` (1, 2, ...): exponential, capped,
    with jitter so that the deliveries of a receiver that was down do not all come back at once."""
    return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** min(attempt - 1, 30)) * random.uniform(0.5, 1.0)


# What readers of a run see of any failed attempt: the same words whatever happened. A run's webhook may
# point anywhere the workers reach; if "connection refused", "HTTP 403" or "no answer" were recorded
# with the run, whoever may enqueue and read runs could map the workers' network (which ports are
# open, which speak HTTP) through it. The reason itself goes to the worker's log.
FAILED = "no 2xx answer (the reason is in the worker's log)"
# A receiver whose every address AGENTPOOL_WEBHOOK_NETWORKS refuses: the same words whatever the address
# (whoever enqueues the run chose the name, and anyone can resolve it; nothing was connected to).
REFUSED = "not sent: the receiver's address is not one the pool's workers may post to (AGENTPOOL_WEBHOOK_NETWORKS)"


@dataclass(frozen=True)
class Failure:
    """What went wrong, in one line for the worker's log (no URL: it may carry a token), and the start of
    the receiver's answer (log only too: an answer read back from wherever the run's webhook pointed,
    an internal service say, must not reach whoever reads the run). The run records ``FAILED``."""

    what: str
    answer: str = ""
    refused: bool = False  # by AGENTPOOL_WEBHOOK_NETWORKS: given up at once, and readers may be told why

    def for_log(self) -> str:
        return f"{self.what}: {self.answer}" if self.answer else self.what


class _Deadline:
    """The end of one attempt. ``left()`` is the time remaining, and raises TimeoutError once none is:
    each socket operation gets only that, so the attempt as a whole, not each read, is bounded (a
    receiver trickling a byte a second would otherwise hold the delivery thread for ever)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the attempt's deadline passed")
        return left


def _resolve(host: str, port: int, deadline: _Deadline) -> list[Any]:
    """getaddrinfo within the deadline. The resolver has no timeout of its own, so it runs in a thread
    that is left behind if it is late (it ends when the resolver gives up: a few seconds)."""
    found: list[Any] = []

    def look_up() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as exc:  # noqa: BLE001 - handed to the caller as is
            found.append(exc)

    thread = threading.Thread(target=look_up, name="agentpool-webhook-dns", daemon=True)
    thread.start()
    thread.join(deadline.left())
    if not found:
        raise TimeoutError(f"resolving {host} took longer than the attempt's deadline")
    if isinstance(found[0], Exception):
        raise found[0]
    return found[0]


class _DeadlineSocket:
    """The connected socket as http.client uses it (``sendall``, ``makefile``, ``close``), every
    operation given only the time left until the attempt's deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # chunk by chunk: a receiver reading slowly cannot stretch the send either
            self.sock.settimeout(self.deadline.left())
            view = view[self.sock.send(view) :]

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        pass  # http.client closes the connection before the answer is read (Connection: close): post does


class _DeadlineReader(io.RawIOBase):
    def __init__(self, owner: _DeadlineSocket) -> None:
        self.owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        self.owner.sock.settimeout(self.owner.deadline.left())
        return self.owner.sock.recv_into(b)


class _Connection(http.client.HTTPConnection):
    """http.client's connection, connected (DNS, TCP, TLS) within the attempt's deadline and then
    reading and writing through a :class:`_DeadlineSocket`."""

    def __init__(self, scheme: str, host: str, port: int | None, deadline: _Deadline, networks: Networks) -> None:
        self.tls = scheme == "https"
        self.default_port = 443 if self.tls else 80  # the Host header names the port only if another
        super().__init__(host, port or self.default_port)
        self.deadline, self.networks = deadline, networks
        self.opened: socket.socket | None = None

    def connect(self) -> None:
        error: OSError = OSError(f"no address for {self.host}")
        refused: AddressRefused | None = None
        tried = False
        for family, kind, proto, _, address in _resolve(self.host, self.port, self.deadline):
            try:  # the address connected to is the one checked: a name rebound meanwhile changes nothing
                self.networks.check(address[0])
            except AddressRefused as exc:
                refused = refused or exc
                continue
            tried = True
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(self.deadline.left())
                sock.connect(address)
                break
            except OSError as exc:  # TimeoutError included: try the next address while time is left
                sock.close()
                error = exc
        else:
            # Refused only if no address was allowed: a public one that did not answer is a failure, retried.
            raise refused if refused is not None and not tried else error
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:  # the handshake is bounded by the timeout as a whole (ssl's own deadline)
                sock.settimeout(self.deadline.left())
                sock = _TLS.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self.opened = sock  # closed by post
        self.sock = _DeadlineSocket(sock, self.deadline)  # type: ignore[assignment]


_TLS = ssl.create_default_context()  # certificates checked as urllib checks them


def post(url: str, body: bytes, headers: dict[str, str], timeout: float, networks: Networks = ANY) -> Failure | None:
    """POST ``body``; None on a 2xx, else the :class:`Failure`. The whole attempt (resolving the host,
    connecting, TLS, sending, the answer's status line, headers and the start of its body) gets
    ``timeout`` seconds. Redirects are not followed; only addresses ``networks`` allows are connected
    to. Never raises: whatever goes wrong is a Failure, so that every attempt is recorded, retried
    and, in the end, given up."""
    deadline = _Deadline(timeout)
    connection = None
    try:
        parts = urlsplit(url)
        connection = _Connection(parts.scheme, parts.hostname or "", parts.port, deadline, networks)
        target = urlunsplit(("", "", parts.path or "/", parts.query, ""))
        connection.request("POST", target, body=body, headers={**headers, "Connection": "close"})
        answer = connection.getresponse()
        status = answer.status
        # The answer is known; the start of its body is for the log only, so a late one changes nothing.
        snippet = _snippet(answer) if not 200 <= status < 300 else ""
    except AddressRefused as exc:  # every address the name has (the first one refused is named)
        return Failure(str(exc), refused=True)
    except TimeoutError:  # socket.timeout is TimeoutError
        return Failure(f"no answer within {timeout:g} s")
    except (ConnectionRefusedError, socket.gaierror) as exc:
        return Failure(f"cannot connect: {exc}")
    except (OSError, http.client.HTTPException) as exc:
        return Failure(f"connection failed: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - anything else (a URL recorded by an older version...) is a failure too
        return Failure(f"could not be sent: {type(exc).__name__}: {exc}")
    finally:
        if connection is not None:
            connection.close()
            if connection.opened is not None:
                connection.opened.close()
    if 200 <= status < 300:
        return None
    redirect = " (redirects are not followed)" if 300 <= status < 400 else ""
    return Failure(f"HTTP {status}{redirect}", snippet)


def _snippet(answer: http.client.HTTPResponse) -> str:
    try:
        text = answer.read(300).decode("utf-8", errors="replace")
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
        failure = post(url, body, headers, self.settings.webhook_timeout, self.settings.webhook_networks)
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
        if failure.refused:  # the pool's policy, not the receiver: the next try would meet it again
            deliveries.done(self.r, claim, "undelivered", error=REFUSED)
            log.error(
                "run %s: webhook %s to %s not sent: %s", claim.run_id, claim.delivery_id, where, failure.for_log()
            )
            return
        if now >= give_up_at:
            deliveries.done(self.r, claim, "undelivered", error=FAILED)
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
        retry_in = min(int(backoff(claim.attempt) * 1000), give_up_at - now)
        deliveries.done(self.r, claim, "retry", error=FAILED, retry_in_ms=retry_in)
        log.warning(
            "run %s: webhook %s to %s failed (attempt %d: %s); next try in %.1f s",
            claim.run_id,
            claim.delivery_id,
            where,
            claim.attempt,
            failure.for_log(),
            retry_in / 1000,
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
