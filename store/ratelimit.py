"""The pool's rate-limit budget per model, shared by every worker: token buckets for requests, input
tokens and output tokens per minute, reserved before a call and settled after it (``store/lua/
limit_reserve.lua``, ``limit_settle.lua``), and a line of waiting calls in the order they began to wait.

Limits come from two places: what an operator set (``Limits`` passed in, from ``AGENTPOOL_RATE_LIMITS``)
and what the API reported in its ``anthropic-ratelimit-*`` headers (learned here); where both exist the
lower one holds. A dimension with neither is not limited.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from agentpool.store.hints import Hints, pool_key
from agentpool.store.keys import LIMIT_MODELS, LimitKeys
from agentpool.store.scripts import Rider, run_script

DIMENSIONS = ("requests", "input", "output")
FORM = "AGENTPOOL_RATE_LIMITS is '<model>=rpm:N,itpm:N,otpm:N;*=rpm:N' (model '*' for every other model)"
SETTLE_BATCH = 400  # settles one script call takes at most (14 arguments each; Lua unpacks up to ~8,000)
TICKET_SLACK_MS = 30_000  # how long past its expected wait a ticket keeps its place in line
# A reservation whose worker died never settles: after an hour it leaves the calls in flight, looked through
# every 10 minutes. No call is in flight that long (AGENTPOOL_MODEL_CALL_TIMEOUT: 10 minutes); one that
# were would only find nothing held when it settles, and give back nothing of its estimate.
HELD_STALE_MS = 3_600_000
HELD_SWEEP_EVERY_MS = 600_000
# How long a worker process trusts that a model is unlimited with replies that carry no rate-limit
# headers (a gateway that strips them, a scripted model), and so calls it without reading its budget.
UNLIMITED_TRUSTED_FOR = 1.0
unlimited_models = Hints()  # per connection pool (a shard's budget) and model (a model id holds no "|")


@dataclass(frozen=True)
class Limits:
    """Per minute: requests, input tokens, output tokens. ``None``: not limited by this source."""

    rpm: int | None = None
    itpm: int | None = None
    otpm: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "itpm", "otpm"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
                raise ValueError(f"rate limit {name} must be a whole number >= 1, got {value!r}")
            if value != int(value):
                raise ValueError(f"rate limit {name} must be a whole number >= 1, got {value!r}")

    def args(self) -> list[int]:
        return [int(v or 0) for v in (self.rpm, self.itpm, self.otpm)]

    def capped_by(self, other: Limits) -> Limits:
        """Each limit the lower of the two; one that only one of them has is kept."""

        def low(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else min(a, b)

        return Limits(low(self.rpm, other.rpm), low(self.itpm, other.itpm), low(self.otpm, other.otpm))


def parse_limits(raw: str) -> dict[str, Limits]:
    """``AGENTPOOL_RATE_LIMITS`` as {model: Limits}; a ValueError saying what is wrong otherwise."""
    out: dict[str, Limits] = {}
    for part in filter(None, (p.strip() for p in raw.split(";"))):
        model, eq, spec = part.partition("=")
        model = model.strip()
        if not eq or not model:
            raise ValueError(f"{FORM}; got {part!r}")
        values: dict[str, int] = {}
        for item in filter(None, (i.strip() for i in spec.split(","))):
            name, colon, number = item.partition(":")
            name = name.strip().lower()
            if not colon or name not in ("rpm", "itpm", "otpm"):
                raise ValueError(f"{FORM}; {item!r} in {model!r} is not rpm:N, itpm:N or otpm:N")
            try:
                value = float(number)
            except ValueError:
                raise ValueError(
                    f"AGENTPOOL_RATE_LIMITS: {model} {name} must be a whole number >= 1, got {number!r}"
                ) from None
            values[name] = value  # type: ignore[assignment]
        try:
            out[model] = Limits(**values)
        except ValueError as exc:
            raise ValueError(f"AGENTPOOL_RATE_LIMITS: {model}: {exc}") from None
        if model != "*":
            try:
                LimitKeys.of(model)
            except ValueError as exc:
                raise ValueError(f"AGENTPOOL_RATE_LIMITS: {exc}") from None
    return out


@dataclass(frozen=True)
class Need:
    input: int
    output: int
    requests: int = 1


@dataclass(frozen=True)
class Reservation:
    model: str
    id: str
    need: Need
    # Granted with room to spare: nobody in line and every limited bucket at least half full after it (its
    # settle may wait to go with others: ``DeferredSettles``).
    roomy: bool = False


@dataclass(frozen=True)
class Wait:
    seconds: float
    # The model's calls are paused pool-wide (``pause``), not waiting for the budget to refill.
    paused: bool = False


@dataclass(frozen=True)
class Unlimited:
    """Nothing limits the model yet (no limit set or learned): no budget is taken. ``started`` counts the
    requests and tokens started while unlimited, this call's included, and the call stays in the held
    hash (under ``id``) until it settles. When its reply teaches the limits, ``settle`` takes off the
    remaining it reports what was started after this call (the API had not counted that yet) and what
    the calls started before it and still in flight need (the API may admit them after this one). ``None``
    once the model's replies were seen to carry no rate-limit headers (``mark_headerless``): nothing is
    counted or held then."""

    started: tuple[int, int, int] | None
    id: str = ""


@dataclass(frozen=True)
class ReserveRequest:
    """One call's reservation as ``limit_reserve`` takes it: made on its own (``reserve``) or by the
    lease's script, with the turn's lease (``agentpool.store.lease.acquire``)."""

    model: str
    ticket: str
    reservation_id: str
    need: Need
    limits: Limits
    minute_s: float

    def keys(self) -> list[str]:
        keys = LimitKeys.of(self.model)
        return [keys.budget, keys.held, keys.waiting, keys.needs, LIMIT_MODELS]

    def args(self) -> list[object]:
        return [
            0,  # unused: the scripts read Redis's clock
            int(self.minute_s * 1000),
            self.model,
            self.ticket,
            self.reservation_id,
            self.need.requests,
            self.need.input,
            self.need.output,
            *self.limits.args(),
            TICKET_SLACK_MS,
        ]

    def answer(self, r: Redis, reply: list[Any]) -> Reservation | Wait | Unlimited:
        """What ``limit_reserve``'s reply from ``r`` says. An answer that the model is unlimited and its
        replies headerless is remembered by this process (``known_unlimited``). An operator's limit for the
        model makes the script never answer so: then it is never remembered, and every call reserves."""
        granted, wait_ms, *started = reply
        if int(granted) in (0, 4):
            return Wait(int(wait_ms) / 1000, paused=int(granted) == 4)
        if int(granted) == 3:
            if not started:
                remember_unlimited(r, self.model)
                return Unlimited(None)
            return Unlimited(tuple(int(n) for n in started), self.reservation_id)  # type: ignore[arg-type]
        return Reservation(self.model, self.reservation_id, self.need, roomy=int(granted) == 1 and started == [1])


def reserve(
    r: Redis, model: str, *, ticket: str, reservation_id: str, need: Need, limits: Limits, minute_s: float
) -> Reservation | Wait | Unlimited:
    """The call's budget, taken now, or how long to wait for it (the ticket then holds a place in line),
    or ``Unlimited`` when no limit is set or learned for the model yet."""
    request = ReserveRequest(model, ticket, reservation_id, need, limits, minute_s)
    return request.answer(r, run_script("limit_reserve", r, request.keys(), request.args()))  # type: ignore[arg-type]


def pause(r: Redis, model: str, seconds: float) -> None:
    """Pause ``model``'s calls pool-wide for ``seconds`` (on Redis's clock; a pause in force is only
    extended): a 429 taught the budget nothing (no rate-limit headers, as from a gateway), so its
    retry-after holds for every call of the model. Each reservation meanwhile answers ``Wait(paused=True)``;
    a process that trusted the model to be unlimited (``known_unlimited``) asks again within a second."""
    run_script("limit_pause", r, [LimitKeys.of(model).budget], [max(1, int(seconds * 1000))])
    forget_unlimited(r, model)


def ticket_of(run_id: str, turn: int) -> str:
    """The ticket a run's turn holds in a model's line while it waits for the budget."""
    return f"{run_id}:{turn}"


def leave_line(r: Redis, model: str, ticket: str) -> None:
    """Take ``ticket`` out of the line of calls waiting for ``model``'s budget: its turn will not call
    (a reservation answered with the lease, for a turn that then ended otherwise). Left there, it would
    hold back the calls behind it until it expired, and its need would be counted in the line's sum,
    which a newcomer waits for."""
    keys = LimitKeys.of(model)
    run_script("limit_leave", r, [keys.budget, keys.waiting, keys.needs], [ticket])


@dataclass(frozen=True)
class Reported:
    """What a reply's ``anthropic-ratelimit-*`` headers said: limits and remaining, per dimension."""

    limits: dict[str, int] = field(default_factory=dict)
    remaining: dict[str, int] = field(default_factory=dict)


def settle(r: Redis, model: str, **how: Any) -> bool:
    """``settle_call`` (``how``: its keyword arguments) sent now, on its own. Returns False if nothing was
    held under the reservation: settled already, dropped (a call started unlimited a minute ago or more,
    or when ``mark_headerless`` ran), or none (``Unlimited(None)``, headers alone)."""
    return bool(settle_call(model, **how).run(r))


def settle_call(
    model: str,
    *,
    reservation: Reservation | Unlimited | None,
    used_input: int,
    used_output: int,
    reported: Reported,
    limits: Limits,
    minute_s: float,
    never_called: bool = False,
    answered: bool = True,
) -> Rider:
    """The script call that corrects ``reservation`` to what the call used (a failed call: what it was
    billed for, often 0) and learns what the API reported; an ``Unlimited`` call gives nothing back (it
    took nothing) and leaves the calls in flight. ``never_called``: the call was reserved but never made (its
    turn ended before it), so its request goes back too. ``answered``: the API answered the call (a refused
    or failed one's give-back stays within the remaining its headers report). Sent later, in another script's round trip (the turn's save
    point A: ``agentpool.runtime.ratelimit``), or now by ``settle``; it answers 1 if it settled."""
    entry = settle_entry(
        reservation=reservation,
        used_input=used_input,
        used_output=used_output,
        reported=reported,
        never_called=never_called,
        answered=answered,
    )
    return Rider(
        "limit_settle", _settle_keys(model), [*_settle_head(model, limits.args(), int(minute_s * 1000)), *entry]
    )


def settle_entry(
    *,
    reservation: Reservation | Unlimited | None,
    used_input: int,
    used_output: int,
    reported: Reported,
    never_called: bool = False,
    answered: bool = True,
) -> list[int | str]:
    """One settle's arguments to ``limit_settle`` (see ``settle_call``), 14 values."""
    rid, back_in, back_out = "", 0, 0
    started = (-1, -1, -1)
    if isinstance(reservation, Unlimited):
        if reservation.started:
            rid, started = reservation.id, reservation.started
    elif reservation is not None:
        rid = reservation.id
        back_in = reservation.need.input - used_input
        back_out = reservation.need.output - used_output
    return [
        1 if never_called and isinstance(reservation, Reservation) else 0,  # requests to give back
        rid,
        back_in,
        back_out,
        *(int(reported.limits.get(d, 0)) for d in DIMENSIONS),
        *(int(reported.remaining.get(d, -1)) for d in DIMENSIONS),
        *started,
        1 if answered else 0,
    ]


def _settle_keys(model: str) -> list[str]:
    keys = LimitKeys.of(model)
    return [keys.budget, keys.held, LIMIT_MODELS]


def _settle_head(model: str, limits: Sequence[int], minute_ms: int) -> list[int | str]:
    return [minute_ms, *limits, model, HELD_STALE_MS, HELD_SWEEP_EVERY_MS]


def may_wait(reservation: Reservation | Unlimited | None, reported: Reported) -> bool:
    """Whether a call's settle may wait up to a second to go with the worker's others (``DeferredSettles``):
    its reservation was granted with room to spare, and its reply says the API's budget is at least half
    left in every dimension it reports. Nearer a limit a give-back is wanted at once (turns may be waiting
    for it), and a call that failed, was started unlimited or taught the limits first settles at once."""
    if not isinstance(reservation, Reservation) or not reservation.roomy:
        return False
    return all(reported.remaining.get(d, -1) * 2 >= limit for d, limit in reported.limits.items())


class DeferredSettles:
    """A worker process's settles that may wait (``may_wait``), sent about once a second with the pool-wide
    counters (``agentpool.runtime.stats_flush``): one ``limit_settle`` call per model for all of them,
    where each would have been a script call and four commands of its own in its turn's save point A.

    While they wait, their unused estimates are not back in the buckets (the budget is a little lower
    than it could be, never higher) and ``agentpool limits`` counts their calls as in flight. A worker
    killed outright loses the last second's: their calls stay counted as in flight until the budget's
    hourly sweep, and their unused estimates come back as the buckets refill (within the minute). A warm
    stop sends them. Sending one twice (its first delivery's reply lost) gives back once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        # (model, operator limits' arguments, minute in ms) -> the settles' arguments (settle_entry)
        self._pending: dict[tuple[str, tuple[int, ...], int], list[list[int | str]]] = {}
        self._closed = False

    def add(self, model: str, limits: Limits, minute_s: float, entry: list[int | str]) -> bool:
        """False once closed: the caller sends the settle with its turn."""
        with self._lock:
            if self._closed:
                return False
            self._pending.setdefault((model, tuple(limits.args()), int(minute_s * 1000)), []).append(entry)
            return True

    def close(self) -> None:
        """No settle waits here any more (its worker stops): what waits is sent by one more ``send``."""
        global _deferred
        with self._lock:
            self._closed = True
        if _deferred is self:
            _deferred = None

    def take(self) -> list[list[Any]]:
        """Everything not sent yet, as JSON can carry it (a forked work horse hands it to its worker)."""
        with self._lock:
            taken, self._pending = self._pending, {}
        return [[model, list(limits), minute_ms, entries] for (model, limits, minute_ms), entries in taken.items()]

    def adopt(self, taken: list[list[Any]]) -> bool:
        """What ``take`` took (here or in a work horse) waits here again; False once closed."""
        with self._lock:
            if self._closed:
                return False
            for model, limits, minute_ms, entries in taken:
                self._pending.setdefault((model, tuple(limits), minute_ms), []).extend(entries)
            return True

    def send(self, r: Redis) -> None:
        """One script call per model (and ``SETTLE_BATCH`` settles). What a lost connection kept from being
        sent is kept and sent by the next call; the error is raised. A batch the script refused (a
        ``ResponseError``: a budget hash it cannot read) is dropped, as a settle sent with its turn would be,
        and the error raised: sent again it would meet the same error every second."""
        with self._sending:
            with self._lock:
                taken, self._pending = self._pending, {}
            groups = list(taken.items())
            try:
                while groups:
                    key, entries = groups[0]
                    model, limits, minute_ms = key
                    batch, rest = entries[:SETTLE_BATCH], entries[SETTLE_BATCH:]
                    args = [*_settle_head(model, limits, minute_ms), *(v for e in batch for v in e)]
                    try:
                        run_script("limit_settle", r, _settle_keys(model), args)
                    except ResponseError:
                        groups[0:1] = [(key, rest)] if rest else []  # refused: sent again, it would fail again
                        raise
                    groups[0:1] = [(key, rest)] if rest else []
            finally:
                if groups:  # kept for the next call, closed or not
                    with self._lock:
                        for key, entries in groups:
                            self._pending.setdefault(key, []).extend(entries)


_deferred: DeferredSettles | None = None


def defer_settles() -> DeferredSettles:
    """Let settles wait in this process from now on (a worker's); the caller sends them regularly, and
    closes them and sends the last when it stops."""
    global _deferred
    if _deferred is None:
        _deferred = DeferredSettles()
    return _deferred


def stop_deferring_settles() -> None:
    """In a forked work horse: its worker's settles are the worker's to send; the horse's own wait in a
    ``defer_settles()`` of its own and go to the worker as the horse ends (``agentpool.worker.forking``)."""
    global _deferred
    _deferred = None


def adopt_settles(r: Redis, taken: list[list[Any]]) -> None:
    """A work horse's deferred settles (``DeferredSettles.take``) into this process's, or sent now where
    settles no longer wait here."""
    deferred = _deferred
    if deferred is None or not deferred.adopt(taken):
        now = DeferredSettles()
        now.adopt(taken)
        now.send(r)


def settle_soon(model: str, limits: Limits, minute_s: float, entry: list[int | str]) -> bool:
    """``entry`` (``settle_entry``) into this process's deferred settles; False where settles do not wait
    (not a worker process): the caller sends it with its turn instead."""
    deferred = _deferred
    return deferred is not None and deferred.add(model, limits, minute_s, entry)


def known_unlimited(r: Redis, model: str) -> bool:
    """Whether this process found ``model`` unlimited and headerless on ``r``'s budget (``reserve``
    answering ``Unlimited(None)``) less than ``UNLIMITED_TRUSTED_FOR`` ago: its calls need no
    reservation meanwhile, one round trip and two commands a turn less. Nothing is lost: that answer
    takes no budget and counts nothing. A reply that does carry the headers teaches the budget its limits
    as before (``forget_unlimited`` ends the trust in the process that got it; the others ask again
    within the second). An operator's limit for the model means ``reserve`` never answers so."""
    return unlimited_models.holds(pool_key(r, model))


def remember_unlimited(r: Redis, model: str) -> None:
    unlimited_models.remember(pool_key(r, model), UNLIMITED_TRUSTED_FOR)


def forget_unlimited(r: Redis, model: str) -> None:
    unlimited_models.forget(pool_key(r, model))


def mark_headerless(r: Redis, model: str) -> None:
    """A reply of ``model`` came back with no rate-limit headers (a gateway that strips them, a scripted
    model without limits): while nothing limits it, its calls stop counting what they start and are not
    held (nothing will be learned), and the calls started unlimited leave the calls in flight now, this one's
    and any whose worker died. Done by the calls in flight when the model is found out, not after."""
    keys = LimitKeys.of(model)
    with r.pipeline(transaction=False) as pipe:
        # The flag first: a reservation after it adds no entry, and one before it is in what is read.
        pipe.hset(keys.budget, "headerless", 1)
        pipe.hgetall(keys.budget)
        _, budget = pipe.execute()
    started_unlimited = [name for name, value in _held(budget).items() if _started_unlimited(value)]
    # 'held:<id>' fields, deleted by name: a reservation made meanwhile is another field, left as it is.
    r.hdel(keys.budget, *started_unlimited, "started:at")


def _held(budget: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The calls in flight of a budget hash as read whole: its 'held:<reservation id>' fields."""
    return {name: value for name, value in budget.items() if name.startswith(b"held:")}


def _started_unlimited(held_value: bytes) -> bool:
    """A held entry of a call started while nothing limited the model: "in out ms requests r i o"
    (a reservation within limits: "in out ms")."""
    return len(held_value.split()) == 7


@dataclass(frozen=True)
class BudgetView:
    model: str
    learned: dict[str, int]
    levels: dict[str, float]  # as last written (not refilled to now)
    at_ms: int
    # Input and output tokens reserved by calls in flight, and how many calls (a call started while nothing
    # limited the model is in flight, with what it needs, until it settles).
    held: dict[str, int]
    waiting: int
    # What the turns waiting in line need together, by dimension (the budget's 'line:sum'); empty when
    # nobody waits, or the line was begun by a release that kept no sum.
    in_line: dict[str, int] = field(default_factory=dict)


def show(r: Redis) -> list[BudgetView]:
    """Every model's budget: what was learned, the buckets, what is reserved now and how many wait."""
    views = []
    for raw in sorted(r.smembers(LIMIT_MODELS)):
        model = raw.decode()
        keys = LimitKeys.of(model)
        with r.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.budget)
            pipe.zcard(keys.waiting)
            budget, waiting = pipe.execute()
        held = _held(budget)
        fields = {k.decode(): v.decode() for k, v in budget.items() if k not in held}
        inflight = {"calls": len(held), "input": 0, "output": 0}
        summed = fields.get("line:sum", "").split()
        in_line = {}
        if waiting and len(summed) == len(DIMENSIONS) and all(part.isdigit() for part in summed):
            in_line = dict(zip(DIMENSIONS, map(int, summed), strict=True))
        for value in held.values():
            parts = value.decode().split()
            inflight["input"] += int(float(parts[0]))
            inflight["output"] += int(float(parts[1]))
        views.append(
            BudgetView(
                model=model,
                learned={d: int(float(fields[f"learned:{d}"])) for d in DIMENSIONS if f"learned:{d}" in fields},
                levels={d: float(fields[f"level:{d}"]) for d in DIMENSIONS if f"level:{d}" in fields},
                at_ms=int(float(fields.get("at", 0))),
                held=inflight,
                waiting=int(waiting),
                in_line=in_line,
            )
        )
    return views
