"""Completion webhooks in Redis: the deliveries a run's status changes record, and their claims.

A delivery is recorded by the write that changes the run's status (``store/lua/_webhook.lua``, inside
``finish``, ``commit_response``, ``fail_unfenced`` and a cancel's transaction), so it exists exactly
when the status does: a worker killed right after the run ended still leaves it for the others. It
sits in the run's ``webhooks`` hash (which expires with the run) and in ``ap:webhooks:due`` (due time),
where the delivery threads of every worker find it (``agentpool.runtime.webhook_delivery``). A worker
claims one delivery at a time with a lease (its place in the due set moves a lease ahead); one killed
while delivering leaves it due again when the lease ends. Leases and due times are read on Redis's clock
(TIME), never a worker's: a worker whose clock runs ahead would otherwise take live claims. What the
run's body says and how it is signed is ``agentpool.webhooks``'s.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack
from redis import Redis
from redis.client import Pipeline

from agentpool.store.clock import now_ms
from agentpool.store.codec import safe_text
from agentpool.store.keys import WEBHOOKS_DUE, RunKeys, check_run_id
from agentpool.store.scripts import compact_source, run_script

EVENTS = ("ended", "waiting_approval")  # what a webhook can be told: the run ended, or waits for a person
MAYBE = "maybe"  # the pool default's events from a process that cannot know the workers' setting


def script_keys(keys: RunKeys) -> list[str]:
    """The keys a status-changing script takes off the end of its KEYS (``take_webhook``)."""
    return [keys.webhooks, WEBHOOKS_DUE]


def stage_record(pipe: Pipeline, keys: RunKeys, status: str, pool_events: str) -> None:
    """Add to a MULTI the recording of the run's delivery for ``status`` (a cancel's transaction)."""
    pipe.eval(
        compact_source("webhook_record"),
        3,
        keys.run,
        *script_keys(keys),
        keys.run_id,
        status,
        now_ms(),
        pool_events,
    )


def split_id(delivery_id: str) -> tuple[str, int]:
    """(run id, delivery number) of a delivery id ``<run id>.<created ms>.<n>``."""
    run_id, _, n = delivery_id.rpartition(".")
    return check_run_id(run_id.partition(".")[0]), int(n)


def due(r: Redis, *, limit: int = 20) -> list[str]:
    """Ids of deliveries due now (and not claimed by a live worker), the longest due first. "Now" is
    Redis's clock, the one claims and retries are scored on (a worker's clock may be off)."""
    seconds, micros = r.time()
    now = seconds * 1000 + micros // 1000
    return [raw.decode() for raw in r.zrangebyscore(WEBHOOKS_DUE, "-inf", now, start=0, num=limit)]


@dataclass(frozen=True)
class Claim:
    delivery_id: str
    run_id: str
    n: int
    token: str
    attempt: int  # this attempt's number, 1 for the first (a killed worker's attempt counts)
    summary: dict[str, Any]  # the run as the status change recorded it (see _webhook.lua)
    result: bytes  # the start of its result (sealed when encryption at rest was on)


NOT_DUE, GONE, DROPPED, LEFT = 0, -1, -2, -3  # what webhook_claim.lua answers instead of a claim


def claim(r: Redis, delivery_id: str, *, lease_ms: int, secret: bool, default: bool) -> Claim | int:
    """Take a due delivery for ``lease_ms`` if this worker can make it (it has the signing ``secret``;
    and a ``default`` URL, for a delivery to the pool default). A Claim; else why not: ``NOT_DUE``
    (another worker has it), ``GONE`` (its run expired), ``DROPPED`` (an app's cancel asked for the
    pool default, which this pool does not have), ``LEFT`` (for a worker that can: noted on it)."""
    run_id, n = split_id(delivery_id)
    keys = RunKeys.of(run_id)
    token = secrets.token_hex(8)
    has = ",".join(name for name, ok in (("secret", secret), ("default", default)) if ok)
    got = run_script("webhook_claim", r, [WEBHOOKS_DUE, keys.webhooks], [delivery_id, n, int(lease_ms), token, has])
    if not isinstance(got, list):
        return int(got)  # type: ignore[call-overload]
    attempt, summary, result = got
    return Claim(delivery_id, run_id, n, token, int(attempt), _summary(summary), result or b"")


def _summary(blob: bytes | None) -> dict[str, Any]:
    """A recorded summary (msgpack packed by Lua: plain strings and numbers); {} if unreadable."""
    try:
        found = msgpack.unpackb(blob or b"", raw=False, unicode_errors="replace", strict_map_key=True)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types for bad bytes
        return {}
    return found if isinstance(found, dict) else {}


def done(r: Redis, claim: Claim, outcome: str, *, error: str = "", retry_in_ms: int = 0) -> bool:
    """Record an attempt's ``outcome``: ``delivered``, ``retry`` (due again ``retry_in_ms`` from now,
    on Redis's clock), or ``undelivered`` (given up). True if recorded (a late failure, from a worker
    whose claim another worker took over, is not)."""
    keys = RunKeys.of(claim.run_id)
    return bool(
        run_script(
            "webhook_done",
            r,
            [WEBHOOKS_DUE, keys.webhooks],
            [claim.delivery_id, claim.n, claim.token, outcome, max(0, int(retry_in_ms)), safe_text(error)[:500]],
        )
    )


def shown_receiver(url: str) -> str:
    """A webhook's ``url`` as readers of the run may see it: ``scheme://host[:port]`` and a short digest
    of the whole URL (so two receivers on one host can be told apart), never its path, query or
    credentials: Slack's and Discord's webhooks carry their secret in the path, others in the query.
    '' stays '' (the pool's default receiver)."""
    if not url:
        return ""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a URL check_url let through (recorded by an older version): nothing of it
        return "(an unreadable URL)"
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    digest = hashlib.sha256(url.encode("utf-8", errors="replace")).hexdigest()[:8]
    return f"{parts.scheme}://{host}{port} (#{digest})"


def bare_url(url: str) -> str:
    """``url`` without credentials or a query: scheme, host, port and path (MCP servers' URLs, see
    agentpool.mcp_tools; a webhook's is shown by ``shown_receiver``, without its path). '' stays ''."""
    if not url:
        return ""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


def deliveries(r: Redis, keys: RunKeys) -> list[dict[str, Any]]:
    """The run's deliveries, oldest first, for ``get_run``, ``agentpool show`` and the dashboard:
    id, event, status (the run's, when recorded), state, attempts, at (recorded, s), last_attempt_at,
    next_at, done_at (s), error (the last failure), waiting (why nobody makes it), url ('' for the pool
    default; scheme, host, port and a digest, never path or query: ``shown_receiver``)."""
    raw = {k.decode(): v for k, v in r.hgetall(keys.webhooks).items()}
    found = []
    for name in sorted((k for k in raw if k.isdigit()), key=int):
        summary = _summary(raw[name])

        def text(field: str, name: str = name) -> str:
            return raw.get(f"{name}:{field}", b"").decode("utf-8", errors="replace")

        def seconds(field: str, name: str = name) -> float | None:
            value = text(field, name)
            return int(value) / 1000 if value.isdigit() else None

        found.append(
            {
                "id": summary.get("id", f"{keys.run_id}.?.{name}"),
                "event": summary.get("event", "?"),
                "status": summary.get("status", "?"),
                "state": text("state") or "?",
                "attempts": int(text("attempts") or 0),
                "at": (summary.get("at") or 0) / 1000,
                "last_attempt_at": seconds("at"),
                "next_at": seconds("next"),
                "done_at": seconds("done"),
                "error": text("error") or None,
                "waiting": text("waiting") or None,
                "url": shown_receiver(summary.get("url", "")),
            }
        )
    return found


def pending_count(r: Redis) -> int:
    """Deliveries not yet made, pool-wide (``agentpool_webhooks_pending``)."""
    return int(r.zcard(WEBHOOKS_DUE))
