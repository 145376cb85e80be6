"""The run lock: a lease with an owner token and a fence.

A token is ``"<fence>:<worker id>"``. The fence is bumped on every acquisition, so a worker that was
frozen past its lease holds a token nobody will ever accept again: every write of a turn is a script
that compares the lease with the writer's token first (see ``store/lua``). The fence of a run only
grows: nothing resets a run's header (``enqueue_run`` refuses or returns an existing run).

Every operation here is safe to deliver twice (see ``store/writes.py``): renew and release are
idempotent, and an acquire carries a request id so that its re-delivery is recognised.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.store.clock import now_ms
from agentpool.store.events import Event, script_args
from agentpool.store.keys import RUNS_WATCH, STATS, RunKeys
from agentpool.store.ratelimit import Reservation, ReserveRequest, Unlimited, Wait
from agentpool.store.records import SCHEMA_VERSION
from agentpool.store.scripts import run_script
from agentpool.store.writes import new_id


class Acquire(enum.IntEnum):
    ACQUIRED = 1
    HELD = 0
    NO_RUN = -1
    STALE = -2
    NOT_ACTIVE = -3
    TOO_NEW = -4
    UNREADABLE = -5


@dataclass(frozen=True)
class AcquireResult:
    code: Acquire
    detail: str  # the token when acquired; otherwise what the code refers to
    then: list[Any] = field(default_factory=list)  # the replies of the reads staged after the script
    recorded: bool = False  # the event (turn_started) was recorded with this acquisition
    reserved: Reservation | Wait | Unlimited | None = None  # what reserving the call with the lease answered

    @property
    def token(self) -> str:
        assert self.code is Acquire.ACQUIRED
        return self.detail


def acquire(
    r: Redis,
    keys: RunKeys,
    *,
    turn: int,
    worker_id: str,
    ttl_ms: int,
    event: Event | None = None,
    then: Callable[[Pipeline], None] | None = None,
    reserve: ReserveRequest | None = None,
    job_id: str = "",
) -> AcquireResult:
    """Take the lease for ``turn``. ``event`` is recorded with it if the turn is to call the model;
    the reads ``then`` stages go out in the same round trip, after the script (their replies are
    wasted when the lease is not taken: a rare stale or duplicate job). They are plain commands, not
    part of the script: a reply Lua hands back costs Redis several times what the same reply costs as a
    command's (an HGETALL of a header: 13 µs against 3 µs here). ``reserve``: the turn's model call,
    reserved in the pool's rate-limit budget by the same script once the lease is taken, unless the
    turn settles tools first (``reserved`` says what the budget answered; None: nothing reserved).
    ``job_id``: the RQ job the turn runs in, which begins the request id the header keeps (``acq``), so
    the reaper can tell a claimed job whose lease lapsed from one whose lease is still to come."""
    script_keys = [keys.run, keys.lease, RUNS_WATCH, keys.events, STATS]
    reserving: list[object] = []
    if reserve is not None:
        script_keys += reserve.keys()
        reserving = reserve.args()
    args = [
        worker_id,
        ttl_ms,
        now_ms(),
        keys.run_id,
        turn,
        SCHEMA_VERSION,
        f"{job_id}/{new_id()}" if job_id else new_id(),  # no "/" in an RQ job id: one token in a logged command
        len(reserving),
        *reserving,
        *script_args(event),
    ]
    reply, *after = run_script.pipelined(r, "lease_acquire", [(script_keys, args)], then)
    code, detail, *rest = reply  # type: ignore[misc]
    recorded = bool(rest and rest[0])
    if event and recorded:
        event.landed()
    reserved = reserve.answer(r, rest[1:]) if reserve is not None and len(rest) > 1 else None
    # A corrupt header can hold any bytes (the status of a NOT_ACTIVE answer): never fail on decoding them.
    text = detail.decode("utf-8", errors="replace") if isinstance(detail, bytes) else str(detail)
    return AcquireResult(Acquire(int(code)), text, after, recorded, reserved)


def renew(r: Redis, keys: RunKeys, token: str, ttl_ms: int) -> bool:
    return renew_many(r, [(keys, token, ttl_ms)])[0]


def renew_many(r: Redis, leases: list[tuple[RunKeys, str, int]]) -> list[bool]:
    """Extend each ``(keys, token, ttl_ms)`` lease still owned, all in one round trip."""
    now = now_ms()
    calls = [([keys.lease, RUNS_WATCH], [token, ttl_ms, now, keys.run_id]) for keys, token, ttl_ms in leases]
    return [bool(kept) for kept in run_script.pipelined(r, "lease_renew", calls)]  # type: ignore[arg-type]


def release(r: Redis, keys: RunKeys, token: str, *, recheck_in_ms: int = 0) -> bool:
    """Compare-and-delete. The reaper looks at the run again after ``recheck_in_ms``."""
    return bool(
        run_script("lease_release", r, [keys.lease, RUNS_WATCH], [token, "", keys.run_id, now_ms() + recheck_in_ms])
    )


def release_dead_holder(r: Redis, keys: RunKeys, worker_id: str) -> bool:
    """Drop the lease if ``worker_id`` holds it. Only for a holder known to be dead (a reaped work horse)."""
    return bool(run_script("lease_release", r, [keys.lease, RUNS_WATCH], ["", f":{worker_id}", keys.run_id, now_ms()]))


def claimed_job_state(r: Redis, keys: RunKeys, job_id: str, grace_ms: int) -> str:
    """For the reaper, of a claimed turn job whose run holds no lease now: ``"lapsed"`` if the job held
    the lease (its worker died or froze), ``"waiting"`` while it may still be about to take it (a worker
    claims a job and takes the lease a round trip later), ``"never"`` once it was first seen waiting
    ``grace_ms`` ago, on Redis's clock: ``keys.unleased`` is set at the first sighting with twice that
    TTL, so more than ``grace_ms`` left means less than ``grace_ms`` passed."""
    with r.pipeline(transaction=False) as pipe:
        pipe.hget(keys.run, "acq")
        pipe.set(keys.unleased, job_id, nx=True, px=2 * grace_ms)
        pipe.get(keys.unleased)
        pipe.pttl(keys.unleased)
        acq, _, seen, ttl = pipe.execute()
    if (acq or b"").partition(b"/")[0] == job_id.encode():
        return "lapsed"
    if seen != job_id.encode():  # another job's sighting, left from an earlier turn
        r.set(keys.unleased, job_id, px=2 * grace_ms)
        return "waiting"
    return "waiting" if int(ttl) > grace_ms else "never"


def holder(r: Redis, keys: RunKeys) -> str | None:
    value = r.get(keys.lease)
    return value.decode() if value else None


def why_not_owner(r: Redis, keys: RunKeys, token: str) -> str | None:
    """None while ``token`` holds the lease of a running run; otherwise why not. A fenced read for a
    tool about to take effect (``ToolCall.ensure_owned``): the same check every fenced write makes."""
    held, status, *_ = run_script("fence_state", r, [keys.lease, keys.run], [""])  # type: ignore[misc]
    if held != token.encode():
        return "another worker has taken the run over" if held else "this worker no longer holds the run's lease"
    if status != b"running":
        return f"the run is {(status or b'gone').decode(errors='replace')}"
    return None
