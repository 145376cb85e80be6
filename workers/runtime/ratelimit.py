"""Model calls inside the pool's rate limits (``agentpool.store.ratelimit``): one budget per model in
Redis, shared by every worker, in the API's own units (requests, input tokens, output tokens a minute).

Before a call its budget is reserved: one request, the input tokens it is estimated to count (the last
call's context plus what the turn added since; the whole request for a first call or a summary) and its
``max_tokens``. After it, the reservation is corrected to the real usage (cache reads are free: the API
does not count them toward the input-token limit on current models), and what a failed call did not use
goes back. The limits are learned from the API's ``anthropic-ratelimit-*`` headers with no configuration;
``AGENTPOOL_RATE_LIMITS`` sets or caps them.

A turn's call is usually reserved with the turn's lease, in the lease's own script: the turn before
knows what the call will need (``next_call``) and its job carries it (``lease_reservation``); a run's
first turn's job carries what ``enqueue_run`` estimated, where it loaded the agent
(``agentpool.runtime.estimate.first_call``), and the turn a message to a completed run queues carries
what the completing turn recorded in its ``status`` event (``next_call``) with the message added
(``agentpool.conversation.send_message``). A turn deferred (to wait for the budget or a concurrency
slot, or after a model error) carries the call it reserved, or was about to (``Turn.note_reserved``),
to its next attempt's job (``agentpool.runtime.deferred``). A turn that then makes no call (it stops at
a limit, waits for a slot, ends otherwise) gives the reservation back, its request included
(``Turn.give_back_prereserved``). Other turns (a first turn enqueued with ``check_agent=False``, a
hand-back's retry, a takeover, a message to a run that stopped) reserve just before the call; a turn a
decision queues runs its tools first, and its next turn's job carries the call.

A call reserved with room to spare (nobody in line, every bucket at least half full) whose reply says
the API's budget is at least half left settles with the worker's others, about once a second, in one
script call (``agentpool.store.ratelimit.DeferredSettles``); any other settles with its turn's save point A.

A call the budget cannot cover now raises ``WaitForBudget``: the turn is deferred (like a backoff: no
worker, thread or lease is held while it waits) and comes back when its place in line (the order it
began to wait in) and the budget allow. A 429 still backs off as before; it also tells the budget the
API's remaining is 0, so the turns behind it wait instead of meeting 429s of their own. A 429 that
carries no rate-limit headers (a gateway's) tells the budget nothing: it pauses the model's calls
pool-wide for its retry-after instead (``_pause``), and every turn waits that out the same way; so does a
``rate_limit_error`` event in the middle of a stream whose 200 carried no such headers.

On a pool of several shards (``AGENTPOOL_SHARDS``) each shard keeps its own budget, holding an equal
part of every limit (set, learned and reported remaining, divided by the number of shards): the shards
together stay within the API's limits with no call to another shard in a turn (docs/sharding.md).
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentpool.agent import Agent
from agentpool.runtime.estimate import estimate_input, estimate_tokens
from agentpool.runtime.model import ModelReply, ModelUnavailable, call_model
from agentpool.store import ratelimit
from agentpool.store.errors import AgentPoolError
from agentpool.store.keys import LimitKeys
from agentpool.store.ratelimit import Limits, Need, Reported, ReserveRequest

if TYPE_CHECKING:
    from redis import Redis

    from agentpool.runtime.settings import Settings
    from agentpool.runtime.turn import Turn

log = logging.getLogger("agentpool.ratelimit")

MIN_WAIT = 0.05
# A 429 that taught the budget nothing pauses the model's calls for its retry-after, at most PAUSE_MAX
# (a gateway's odd header must not stop the pool for an hour), or PAUSE_WITHOUT_RETRY_AFTER if it gave
# none; the turns it held come back spread over up to PAUSE_SPREAD more.
PAUSE_MAX = 60.0
PAUSE_WITHOUT_RETRY_AFTER = 2.0
PAUSE_SPREAD = 1.0
_DIMENSIONS = {"requests": "requests", "input-tokens": "input", "output-tokens": "output"}


class WaitForBudget(AgentPoolError):
    """The pool's budget for the model cannot cover this call yet, or its calls are ``paused`` after a
    429 that taught nothing: defer the turn ``seconds``."""

    def __init__(self, model: str, seconds: float, *, paused: bool = False) -> None:
        why = "the pause of its calls after a 429" if paused else "its rate-limit budget"
        super().__init__(f"waiting {seconds:.2f} s for {model}: {why}")
        self.model, self.seconds, self.paused = model, max(MIN_WAIT, seconds), paused


def _rate_limited(exc: ModelUnavailable) -> bool:
    """A 429, or the API's ``rate_limit_error`` as an ``error`` event after the 200 (no status then)."""
    return exc.status == 429 or (exc.status is None and exc.kind == "rate_limit_error")


def _pause(turn: Turn, model: str, exc: ModelUnavailable) -> None:
    """A 429 without rate-limit headers (a gateway's) teaches the budget nothing: its retry-after (or a
    short pause) holds the model's calls pool-wide, so the pool's other turns wait it out instead of
    each meeting a 429 of its own (``agentpool.store.ratelimit.pause``)."""
    seconds = exc.retry_after if exc.retry_after and exc.retry_after > 0 else PAUSE_WITHOUT_RETRY_AFTER
    try:
        ratelimit.pause(turn.r, model, min(seconds, PAUSE_MAX))
    except Exception:  # the call's own backoff still holds; only the pool's other turns are not told
        log.exception("run %s: could not pause %s's calls after a 429", turn.run_id, model)


def limits_for(configured: Mapping[str, Limits], model: str) -> Limits:
    return configured.get(model) or configured.get("*") or Limits()


def shard_part(limits: Limits, shards: int) -> Limits:
    """One shard's part of the pool's limits (the same limits with one shard or none)."""
    if shards <= 1:
        return limits

    def part(value: int | None) -> int | None:
        return None if value is None else max(1, int(value) // shards)

    return Limits(part(limits.rpm), part(limits.itpm), part(limits.otpm))


def shard_reported(said: Reported, shards: int) -> Reported:
    """One shard's part of what the API's headers reported for the whole organization."""
    if shards <= 1:
        return said
    return Reported(
        {dim: max(1, value // shards) for dim, value in said.limits.items()},
        {dim: value // shards for dim, value in said.remaining.items()},
    )


def reported(headers: Mapping[str, str]) -> Reported:
    """The limits and remaining budget a reply's ``anthropic-ratelimit-*`` headers state."""
    limits: dict[str, int] = {}
    remaining: dict[str, int] = {}
    for api_name, dim in _DIMENSIONS.items():
        for part, into in (("limit", limits), ("remaining", remaining)):
            value = headers.get(f"anthropic-ratelimit-{api_name}-{part}")
            if value is None:
                continue
            try:
                number = int(value)
            except ValueError:
                continue  # a gateway's odd header: nothing learned from it
            if number >= (1 if part == "limit" else 0):
                into[dim] = number
    return Reported(limits, remaining)


def configured_limits(settings: Settings, model: str) -> Limits:
    """The limits an operator set for ``model``, this shard's part of them."""
    return shard_part(limits_for(settings.rate_limits, model), len(settings.shards))


def next_call(
    turn: Turn, agent: Agent, context_tokens: int, added: list[dict[str, Any]]
) -> tuple[str, int, int] | None:
    """The next turn's call as its job carries it, for its lease to reserve: (model, input tokens, output
    tokens), estimated as ``limited_call`` will (the context ``context_tokens`` counted by this turn's reply,
    and the messages ``added`` after it). None when nothing is to be reserved (the limiter off, the model
    known unlimited here) or nothing tells the context's size."""
    if not turn.settings.rate_limiter or not context_tokens or ratelimit.known_unlimited(turn.r, agent.model):
        return None
    return agent.model, int(context_tokens) + estimate_tokens(added), int(agent.max_tokens)


def lease_reservation(r: Redis, settings: Settings, run_id: str, turn: int, carried: Any) -> ReserveRequest | None:
    """The reservation of the call a turn's job carries (``next_call``), to be made with the turn's lease;
    None when the limiter is off, the model is known unlimited here, or the job carries none (or nonsense)."""
    if not settings.rate_limiter or not isinstance(carried, (list, tuple)) or len(carried) != 3:
        return None
    model, tokens_in, tokens_out = carried
    counts = (tokens_in, tokens_out)
    if not isinstance(model, str) or any(type(n) is not int or n < 1 for n in counts):
        return None
    try:
        LimitKeys.of(model)
    except ValueError:
        return None
    if ratelimit.known_unlimited(r, model):
        return None
    return ReserveRequest(
        model,
        ticket=ratelimit.ticket_of(run_id, turn),
        reservation_id=uuid.uuid4().hex,
        need=Need(tokens_in, tokens_out),
        limits=configured_limits(settings, model),
        minute_s=settings.rate_limit_minute,
    )


def limited_call(
    turn: Turn,
    agent: Agent,
    messages: list[dict[str, Any]],
    *,
    last_reply: Mapping[str, Any] | None = None,
    summary: bool = False,
    **kwargs: Any,
) -> ModelReply:
    """``call_model`` inside the pool's budget for ``agent.model``; raises ``WaitForBudget`` instead of
    calling when the budget cannot cover it yet. The call reserved with the turn's lease, if any, is
    this one (the first of the turn for its model)."""
    settings = turn.settings
    if not settings.rate_limiter:
        return call_model(agent, messages, summary=summary, **kwargs)
    shards = len(settings.shards)
    configured = configured_limits(settings, agent.model)
    minute = settings.rate_limit_minute
    got = turn.take_prereserved(agent.model)  # what the budget answered the lease, or None
    if got is None and ratelimit.known_unlimited(turn.r, agent.model):
        got = ratelimit.Unlimited(None)
    elif got is None:
        max_tokens = agent.compaction.summary_max_tokens if summary and agent.compaction else agent.max_tokens
        need = Need(estimate_input(agent, messages, None if summary else last_reply), int(max_tokens))
        turn.note_reserved(agent.model, need)
        got = ratelimit.reserve(
            turn.r,
            agent.model,
            ticket=ratelimit.ticket_of(turn.run_id, turn.turn),
            reservation_id=uuid.uuid4().hex,
            need=need,
            limits=configured,
            minute_s=minute,
        )
    if isinstance(got, ratelimit.Wait):
        # The turns a pause held come back spread over a moment, not all at its last millisecond.
        spread = random.uniform(0, min(PAUSE_SPREAD, got.seconds / 4)) if got.paused else 0.0
        raise WaitForBudget(agent.model, got.seconds + spread, paused=got.paused)
    reservation = got
    used_in = used_out = 0
    headers: Mapping[str, str] = {}
    answered = False
    try:
        reply = call_model(agent, messages, summary=summary, **kwargs)
        used_in = reply.usage.get("input_tokens", 0) + reply.usage.get("cache_creation_input_tokens", 0)
        used_out = reply.usage.get("output_tokens", 0)
        headers = reply.limits
        answered = True
        return reply
    except ModelUnavailable as exc:
        # What a failed call did not use goes back; a cut stream was billed for what it had reported.
        used_in = exc.spent.get("input_tokens", 0) + exc.spent.get("cache_creation_input_tokens", 0)
        used_out = exc.spent.get("output_tokens", 0)
        headers = exc.limits
        if _rate_limited(exc) and not reported(headers).limits:
            _pause(turn, agent.model, exc)
        raise
    finally:
        learned = shard_reported(reported(headers), shards)
        if learned.limits:
            ratelimit.forget_unlimited(turn.r, agent.model)  # the model has limits after all: reserve again
        counted = isinstance(reservation, ratelimit.Unlimited) and bool(reservation.started)
        headerless = answered and counted and not learned.limits
        try:
            if headerless:
                # A reply that carries no rate-limit headers: nothing will be learned, so stop counting
                # (this call leaves the calls in flight, with every other call started unlimited).
                ratelimit.mark_headerless(turn.r, agent.model)
            # A call started unlimited is held until it settles, headers or not.
            held = isinstance(reservation, ratelimit.Reservation) or (counted and not headerless)
            if held or learned.limits or learned.remaining:
                how = {
                    "reservation": reservation,
                    "used_input": used_in,
                    "used_output": used_out,
                    "reported": learned,
                    "answered": answered,
                }
                # With room to spare, with the worker's others within a second; otherwise in save point A's
                # round trip, or on its own if the turn has none.
                soon = answered and ratelimit.may_wait(reservation, learned)
                if not (soon and ratelimit.settle_soon(agent.model, configured, minute, ratelimit.settle_entry(**how))):
                    turn.settle_later(ratelimit.settle_call(agent.model, limits=configured, minute_s=minute, **how))
        except Exception:
            # The budget is corrected by its own refill; the call's outcome matters more than this.
            log.exception("run %s: could not settle the rate-limit reservation", turn.run_id)
