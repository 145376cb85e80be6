"""Hand-backs: a turn given back on purpose by a worker that cannot do it, for another that can.

A worker without the encryption key, with a key that does not open the record (a rotation reaching
workers one at a time), with code older than the record, or unable to import the run's agent, is
not a crash and not a fault of the run: another worker may well do the turn. The hand-back is
recorded in the run's ``handback`` hash (``store/lua/hand_back.lua``), not in its header, and the
run is due in the watch set when its backoff ends; the reaper then re-enqueues the turn without
counting an attempt (``agentpool.runtime.takeover``). The first save point a worker makes deletes the
record. ``agentpool show``, ``runs``, ``watch`` and the dashboard read it to say why a run waits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from redis import Redis

from agentpool.store import writes
from agentpool.store.clock import now_ms
from agentpool.store.events import Event, script_args
from agentpool.store.keys import RUNS_WATCH, STATS, RunKeys
from agentpool.store.scripts import run_script

# Why a turn was handed back (the ``reason`` field), with the words ``show`` uses.
REASONS = {
    "key_missing": "this worker has no encryption key (AGENTPOOL_ENCRYPTION_KEY) and the run is encrypted",
    "key_not_held": "the run is encrypted with a key this worker does not have (a key rotation?)",
    "too_new": "the run was written by a newer agentpool than this worker runs",
    "agent_not_loadable": "this worker cannot load the run's agent",
    # The durability guard (store/durability.py): a tool's intent was not acknowledged by the replicas
    # asked for in time; the call did not run and is retried, never run unguarded.
    "not_replicated": (
        "waiting for a replica to acknowledge a tool's intent (the durability guard, AGENTPOOL_REPLICA_ACKS); "
        "bring a replica back, or lower AGENTPOOL_REPLICA_ACKS knowingly"
    ),
    # Not a worker that cannot do the turn: a call a dead or frozen worker started may still take effect
    # until its timeout (plus AGENTPOOL_TAKEOVER_MARGIN) has passed; nothing may repeat or verify it before.
    "earlier_attempt": "a call another worker started may still be running; the turn waits until it cannot",
}
FIRST_DELAY_MS = 1_000
LONGEST_DELAY_MS = 60_000


@dataclass(frozen=True)
class HandBack:
    reason: str
    detail: str
    worker: str
    since: float  # epoch seconds of the first hand-back for this reason in a row
    until: float  # epoch seconds when the turn is re-enqueued
    count: int  # hand-backs in a row (any reason)
    job: str  # the job that was handed back

    def describe(self) -> str:
        return REASONS.get(self.reason, self.reason)


def hand_back(
    r: Redis,
    keys: RunKeys,
    *,
    token: str,
    reason: str,
    detail: str,
    worker: str,
    job: str,
    until: float | None = None,
    event: Event | None = None,
) -> HandBack | None:
    """Record the hand-back, drop the lease ``token`` (if the turn took it: '' otherwise) and make
    the run due when its backoff ends (or at ``until``, epoch seconds, when given). Returns the record,
    or None if the lease was not the turn's any more (another worker owns the run) or the run has
    ended or is gone (a stale job's turn: nobody will take it again); then nothing was written."""
    now = now_ms()
    reply = run_script(
        "hand_back",
        r,
        [keys.run, keys.lease, RUNS_WATCH, keys.handback, keys.events, STATS],
        [
            token,
            reason,
            detail[:2000],
            worker,
            now,
            keys.run_id,
            job,
            FIRST_DELAY_MS,
            LONGEST_DELAY_MS,
            writes.new_id(),
            "" if until is None else int(until * 1000),
            *script_args(event),
        ],
    )
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    if text == "-1":
        return None
    until, since, count = (int(x) for x in text.split(":"))
    if event:
        event.landed()
    return HandBack(reason, detail[:2000], worker, since / 1000, until / 1000, count, job)


def decode(raw: Mapping[bytes, bytes]) -> HandBack | None:
    """The record from an HGETALL of ``keys.handback``; None if there is none (or it does not decode:
    it only ever explains a wait, and a damaged one must not stop a reader)."""
    if not raw or b"reason" not in raw:
        return None

    def text(name: str) -> str:
        return raw.get(name.encode(), b"").decode("utf-8", errors="replace")

    try:
        return HandBack(
            reason=text("reason"),
            detail=text("detail"),
            worker=text("worker"),
            since=int(raw.get(b"since") or 0) / 1000,
            until=int(raw.get(b"until") or 0) / 1000,
            count=int(raw.get(b"count") or 0),
            job=text("job"),
        )
    except ValueError:
        return None


def read(r: Redis, keys: RunKeys) -> HandBack | None:
    return decode(r.hgetall(keys.handback))
