"""Completion webhooks: what agentpool POSTs when a run ends, how it is signed, and ``verify`` for receivers.

A run enqueued with ``enqueue_run(..., webhook="https://...")`` (or any run, when the workers have a
pool default, ``AGENTPOOL_WEBHOOK_URL``) is POSTed a JSON summary when it ends (completed, failed,
stopped, cancelled) and, if asked with ``webhook_events=("ended", "waiting_approval")``, when it starts
waiting for a person. Signed as Stripe signs its webhooks::

    Agentpool-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>" with the secret>
    Agentpool-Delivery: <delivery id, the same on every retry of one delivery>

with the secret every worker reads from ``AGENTPOOL_WEBHOOK_SECRET``. A receiver checks both with
:func:`verify` and drops a delivery id it has seen (delivery is at least once). See docs/shared-pool.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from agentpool.store.errors import AgentPoolError
from agentpool.store.records import RESULT_SEALED_PREFIX, USAGE_FIELDS
from agentpool.store.webhooks import EVENTS, shown_receiver

SIGNATURE_HEADER = "Agentpool-Signature"
DELIVERY_HEADER = "Agentpool-Delivery"
RESULT_CHARS = 10_000  # the start of the result a body carries
MIN_SECRET_CHARS = 16

__all__ = [
    "DELIVERY_HEADER",
    "EVENTS",
    "SIGNATURE_HEADER",
    "WebhookSignatureError",
    "body_of",
    "check_events",
    "check_url",
    "sign",
    "verify",
]


class WebhookSignatureError(AgentPoolError, ValueError):
    """:func:`verify` refused a delivery: no or a malformed ``Agentpool-Signature`` header, a timestamp
    outside the tolerance (a replay, or a clock far off), or a signature that does not match the body
    with this secret (a forgery, a body changed on the way, or the wrong secret)."""


def check_url(url: object, *, subject: str = "webhook") -> str:
    """``url`` if agentpool can POST to it (an ``http://`` or ``https://`` URL with a host); otherwise
    a one-line ValueError that does not echo the URL (it may carry a token)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{subject} must be an http:// or https:// URL, got {type(url).__name__} {url!r}"[:200])
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(f"{subject} is not a valid URL (a bad port or host)") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{subject} must be an http:// or https:// URL, got a {parts.scheme or 'schemeless'} one")
    if not parts.hostname:
        raise ValueError(f"{subject} must name a host: {parts.scheme}://<host>[:port]/path")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{subject} must not hold credentials (user:password@): deliveries are signed instead")
    if any(c.isspace() or ord(c) < 32 for c in url) or len(url) > 2000:
        raise ValueError(f"{subject} holds whitespace or control characters, or is longer than 2000 characters")
    # An HTTP request line is ASCII: a URL with any other character could never be POSTed (each attempt
    # would fail the same way until the delivery is given up a day later), so it is refused here, now.
    if not url.isascii():
        raise ValueError(
            f"{subject} must be ASCII: percent-encode the path and query (caf%C3%A9), "
            "write an international host name in its xn-- (IDNA) form"
        )
    return url


def check_events(events: object, *, subject: str = "webhook_events") -> tuple[str, ...]:
    """The events as a tuple, each one of ``EVENTS`` (``ended``, ``waiting_approval``), at least one."""
    chosen = (events,) if isinstance(events, str) else tuple(events) if isinstance(events, Iterable) else ()
    unknown = [e for e in chosen if e not in EVENTS]
    if not chosen or unknown:
        raise ValueError(f"{subject} must name one or more of {', '.join(EVENTS)}; got {events!r}")
    return tuple(dict.fromkeys(chosen))  # type: ignore[arg-type]


def shown_url(url: str) -> str:
    """The URL for logs and ``show``: scheme, host and port and a digest of the whole URL; never its
    path, query or credentials (``shown_receiver``)."""
    return shown_receiver(url) or "the pool default (AGENTPOOL_WEBHOOK_URL)"


def sign(body: bytes, secret: str, *, at: int | None = None) -> str:
    """The ``Agentpool-Signature`` header's value for ``body`` signed now (or at ``at``)."""
    t = int(time.time()) if at is None else int(at)
    return f"t={t},v1={_hmac(secret, t, body)}"


def _hmac(secret: str, t: int, body: bytes) -> str:
    return hmac.new(secret.encode("utf-8"), f"{t}.".encode() + body, hashlib.sha256).hexdigest()


def verify(
    body: bytes | str, header: str | None, secret: str | Sequence[str], tolerance: float | None = 300
) -> dict[str, Any]:
    """Check a delivery's ``Agentpool-Signature`` ``header`` against its raw ``body`` (the bytes as
    received, before any JSON parsing) and return the event, parsed.

    ``secret`` is ``AGENTPOOL_WEBHOOK_SECRET`` (or several, while rotating it: any one matching is
    enough). The header's timestamp must be within ``tolerance`` seconds of this machine's clock (None:
    not checked), which refuses a delivery captured and replayed later; retries are signed anew, so a
    real retry always passes. Raises :class:`WebhookSignatureError` with the reason otherwise. The
    delivery id (``Agentpool-Delivery`` header, and ``delivery`` in the event) is the same on every
    retry: drop one you have already handled."""
    raw = body.encode("utf-8") if isinstance(body, str) else bytes(body)
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets or not all(isinstance(s, str) and s for s in secrets):
        raise WebhookSignatureError("no secret to verify with (give AGENTPOOL_WEBHOOK_SECRET's value)")
    if not header:
        raise WebhookSignatureError(f"no {SIGNATURE_HEADER} header: not a delivery signed by agentpool")
    t, signatures = _parse(header)
    if tolerance is not None and abs(time.time() - t) > tolerance:
        raise WebhookSignatureError(
            f"{SIGNATURE_HEADER} timestamp is {time.time() - t:+.0f} s from now, beyond the tolerance of "
            f"{tolerance:g} s: a replayed delivery, or a clock far off"
        )
    expected = [_hmac(s, t, raw) for s in secrets]
    if not any(hmac.compare_digest(e, given) for e in expected for given in signatures):
        raise WebhookSignatureError(
            "signature does not match: the body was changed (verify the raw bytes), or it was signed with another secret"
        )
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise WebhookSignatureError(f"signed body is not JSON: {exc}") from None


# ASCII only: str.isdigit() takes other scripts' digits ("\u0661"), and hmac.compare_digest raises
# TypeError, not a refusal, on a non-ASCII str. Anything else in the header is not ours: ignored.
_TIMESTAMP = re.compile(r"[0-9]{1,12}", re.ASCII)
_SIGNATURE = re.compile(r"[0-9a-fA-F]{1,128}", re.ASCII)


def _parse(header: str) -> tuple[int, list[str]]:
    t: int | None = None
    signatures = []
    for item in header.split(","):
        name, eq, value = item.strip().partition("=")
        value = value.strip()
        if not eq:
            continue
        if name == "t" and _TIMESTAMP.fullmatch(value):
            t = int(value)
        elif name == "v1" and _SIGNATURE.fullmatch(value):
            signatures.append(value.lower())
    if t is None or not signatures:
        raise WebhookSignatureError(f"malformed {SIGNATURE_HEADER} header: expected t=<unix seconds>,v1=<hex>")
    return t, signatures


def body_of(
    delivery_id: str, run_id: str, summary: Mapping[str, Any], result: bytes, *, with_result: bool
) -> dict[str, Any]:
    """The JSON a delivery POSTs, from the summary its status change recorded (store/lua/_webhook.lua).

    ``result`` is the start of the run's result (sealed when encryption at rest was on); the body
    carries its first ``RESULT_CHARS`` characters unless ``with_result`` is False (encryption at rest
    is on in this worker) or it is sealed: then ``result`` is null. No secrets: the run's summary only."""

    def number(name: str, kind: type[int | float] = int) -> Any:
        try:
            return kind(summary.get(name) or 0)
        except (TypeError, ValueError):
            return kind(0)

    own = {name: number(name) for name in USAGE_FIELDS}
    usage = {name: own[name] + number(f"tree_{name}") for name in USAGE_FIELDS}
    cost = number("cost_usd", float) + number("tree_cost_usd", float)
    text = result.decode("utf-8", errors="ignore")
    withheld = not with_result or text.startswith(RESULT_SEALED_PREFIX)
    truncated = len(text) > RESULT_CHARS or number("result_bytes") > len(result)
    event = summary.get("event", "ended")
    run: dict[str, Any] = {}
    if event == "waiting_approval":  # the calls it waits on, each decided by its id
        calls = [entry.partition(" ") for entry in str(summary.get("awaiting") or "").split(",") if entry]
        run["awaiting"] = [{"tool_use_id": call_id, "tool": tool} for call_id, _, tool in calls]
    return {
        "type": f"run.{event}",
        "delivery": delivery_id,
        "created": number("at") / 1000,
        "run": {
            "id": run_id,
            "agent": summary.get("agent", ""),
            "status": summary.get("status", ""),
            "turns": number("turns"),
            "usage": usage,
            "cost_usd": cost,
            "error": summary.get("error") or None,
            "result": None if withheld else text[:RESULT_CHARS],
            "result_truncated": False if withheld else truncated,
            "queue": summary.get("queue") or "default",
            "parent": summary.get("parent") or None,
            "created_at": number("created_at") / 1000,
            **run,
        },
    }


def encode(body: Mapping[str, Any]) -> bytes:
    """The bytes POSTed (and signed): compact JSON, UTF-8."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def check_secret(secret: str, *, subject: str = "AGENTPOOL_WEBHOOK_SECRET") -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{subject} is too short ({len(secret)} characters): use at least {MIN_SECRET_CHARS} random "
            "characters (agentpool genkey prints one)"
        )
    return secret
