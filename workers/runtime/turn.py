"""One RQ job = one agent turn: reconcile what a dead worker left, call the model, run the tools
(``agentpool.runtime.settle``), commit.

The order of writes is the whole point (see DESIGN.md, "Save points inside a turn"):

1. take the lease for exactly this turn (a stale or duplicate job stops here, having done nothing);
2. tool_uses left pending by a dead worker are reconciled against the ledger;
3. guards (max_turns) may stop the run, resumably;
4. the model is called; save point A counts its spend and commits its response and pending
   tool_uses before any tool runs;
5. each tool: intent in the ledger, the tool, outcome in the ledger;
6. save point B: the tool results and the next turn's job, in one transaction.

Every write is fenced by the lease token, so a worker that lost its lease (frozen, partitioned)
commits nothing, writes no ledger entry and starts no tool.

A turn this worker cannot do (no encryption key, a key it does not have, a record newer than its
code, an agent it cannot import) is handed back for another worker (``agentpool.store.handback``):
not a crash, not a failure of the run.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from redis import Redis
from redis.exceptions import RedisError
from rq import get_current_job
from rq.job import Job
from rq.timeouts import JobTimeoutException

from agentpool.agent import Agent
from agentpool.pricing import price_of
from agentpool.runtime import compaction, tracing, tree
from agentpool.runtime.answers import FINISHED_STOPS
from agentpool.runtime.answers import trailing_text as _trailing_text
from agentpool.runtime.estimate import call_field
from agentpool.runtime.faults import fault
from agentpool.runtime.heartbeat import keep_alive
from agentpool.runtime.jobs import (
    carried_call,
    deferred_member,
    ending_of,
    mark_ended,
    remember_queue,
    requeued,
    stage_turn,
    turn_job,
)
from agentpool.runtime.limits import Limits
from agentpool.runtime.loader import AgentNotFound, load_agent
from agentpool.runtime.model import ContextTooLong, ModelQuotaExhausted, ModelRejected, ModelReply, ModelUnavailable
from agentpool.runtime.ratelimit import WaitForBudget, configured_limits, lease_reservation, next_call
from agentpool.runtime.settings import Settings, connect
from agentpool.runtime.settle import EarlierAttemptMayRun, Settlement
from agentpool.runtime.stream import LiveOutput
from agentpool.runtime.subagents import late_answer, wake_parent_of
from agentpool.store import checkpoint, concurrency, handback, live, ratelimit, spend, stats, window
from agentpool.store.clock import now_ms
from agentpool.store.crypto import EncryptionKeyMissing, KeyNotHeld
from agentpool.store.durability import NotReplicated
from agentpool.store.errors import (
    LeaseLost,
    LedgerMismatch,
    MessagesWaiting,
    RunNotActive,
    SchemaTooNew,
    TurnMoved,
    UnreadableRecord,
)
from agentpool.store.events import Event, emit
from agentpool.store.keys import RunKeys
from agentpool.store.lease import Acquire, AcquireResult, acquire, release
from agentpool.store.ledger import Outcome
from agentpool.store.records import TERMINAL_STATUSES, USAGE_FIELDS, RunState
from agentpool.store.scripts import Rider

log = logging.getLogger("agentpool.turn")

# Continue with no new user message (after "compaction", the API's pause_after_compaction, the model
# goes on from the compaction block).
CONTINUE_STOPS = ("pause_turn", "max_tokens", "compaction")
FAILED_STOPS = {
    "refusal": "the model declined to continue (stop_reason: refusal)",
}
# The reply ran into the context window: kept like max_tokens; the next request compacts first, and with
# compaction off the run stops (resumable) instead.
OVERFLOW = "model_context_window_exceeded"
# A turn waiting for a slot of its concurrency key is woken when one frees; this is the fallback.
SLOT_POLL = 30.0
SLOT_GRACE = 30.0  # how long past its poll a waiter keeps its place in line
# After an unexpected error, the turn is re-enqueued by the reaper after this pause.
CRASH_RECHECK_MS = 5_000
# What this worker cannot do but another may: the turn is handed back, never failed.
HANDED_BACK: tuple[tuple[type[Exception], str], ...] = (
    (EncryptionKeyMissing, "key_missing"),
    (KeyNotHeld, "key_not_held"),
    (SchemaTooNew, "too_new"),
    (AgentNotFound, "agent_not_loadable"),
    (NotReplicated, "not_replicated"),
)


def worker_identity() -> str:
    """``<rq worker name>.<pid>``: the worker's parent can release the lease of a horse it saw die."""
    return f"{os.environ.get('RQ_WORKER_ID') or socket.gethostname()}.{os.getpid()}"


def _window_from(job: Job | None) -> int | None:
    """Where the job's meta says the run's window starts; None if it does not say (or says nonsense)."""
    start = (job.meta or {}).get("window") if job is not None else None
    return start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else None


def run_turn(run_id: str, turn: int) -> str:
    """The RQ job function. Returns a one-word summary RQ keeps briefly; the checkpoint is the truth.
    The job's meta may say where the run's window started when the turn before queued this one
    (``window``: see ``store.window``), so the lease's round trip reads the messages from there with no
    look at the header first, and what the turn's model call will need (``call``), so the lease's script
    reserves it in the pool's rate-limit budget."""
    job = get_current_job()
    r = job.connection if job is not None else connect()
    settings = Settings.from_env()
    keys = RunKeys.of(run_id)
    window_from = _window_from(job)
    watch = live.WatchLookup(r)
    reserving = lease_reservation(r, settings, run_id, turn, carried_call(job))
    job_id = job.id if job is not None else ""
    # Only a re-enqueued turn can follow an attempt whose worker died during its call: the others skip
    # the look at the note such a call left.
    taken_over = requeued(job)
    # One round trip takes the lease (recording turn_started), reserves the call and reads the run it now owns.
    got = acquire(
        r,
        keys,
        turn=turn,
        worker_id=worker_identity(),
        ttl_ms=settings.lease_ttl_ms,
        event=Event.of(run_id, "turn_started", turn=turn),
        then=lambda pipe: (
            window.stage_load(pipe, keys, start=window_from),
            taken_over and pipe.get(keys.call),  # a call an earlier attempt noted as billed (spend.note_call)
            watch.stage(pipe, keys),
        ),
        reserve=reserving,
        job_id=job_id,
    )
    if got.code is Acquire.TOO_NEW:
        # The record is left untouched: the hand-back is recorded beside it, the lease was never taken.
        detail = f"run {run_id} has schema version {got.detail}, newer than this worker understands"
        return _hand_back(r, keys, got, "", SchemaTooNew(detail), job_id)
    if got.code is Acquire.UNREADABLE:
        reason = f"run header field {got.detail!r} is unreadable; data left as found"
        checkpoint.fail_unfenced(r, run_id, reason, retention_s=settings.retention, pool_webhook=settings.pool_webhook)
        return "unreadable"
    if got.code is not Acquire.ACQUIRED:
        if reserving is not None and _ended_for_good(got):
            # The run failed or was deleted while this turn waited in the budget's line (a cancel took
            # its ticket out already): nobody will make its call, and left there, its ticket would hold
            # back every call behind it until its place expired, half a minute after now.
            try:
                ratelimit.leave_line(r, reserving.model, reserving.ticket)
            except RedisError as exc:  # the job is stale all the same: its ticket expires as it would have
                log.warning("run %s turn %s: could not leave the budget's line: %s", run_id, turn, exc)
        log.info("run %s turn %s: %s (%s); nothing to do", run_id, turn, got.code.name.lower(), got.detail)
        return got.code.name.lower()
    token = got.token
    stats.hand_over()  # the turn's start is counted: a milestone
    work = Turn(r, keys, token, turn, settings, window_from=window_from, job=job)
    if reserving is not None and got.reserved is not None:
        work.prereserved = (reserving, got.reserved)
    with keep_alive(r, keys, token, settings.lease_ttl_ms), tracing.turn_span(r, keys, turn, got.then[0]) as span:
        try:
            header, loaded, *rest = got.then
            noted = rest.pop(0) if taken_over else None
            outcome = work.run(header, loaded, watched=watch.watched(rest), noted=noted)
            tracing.set_attributes(span, **{"agentpool.turn.outcome": outcome})
            return outcome
        except (LeaseLost, RunNotActive) as exc:
            log.warning("run %s turn %s: %s", run_id, turn, exc)
            return "abandoned"
        except TurnMoved as exc:
            # Redis lacks an earlier write of this turn (a failover lost save point A, not the lease):
            # nothing more of it lands; the reaper re-enqueues the run's turn as Redis has it, now.
            log.warning("run %s turn %s: %s", run_id, turn, exc)
            release(r, keys, token)
            return "redone"
        except EarlierAttemptMayRun as wait:
            return _wait_for_earlier_attempt(r, keys, token, wait, job_id)
        except (EncryptionKeyMissing, KeyNotHeld, SchemaTooNew, AgentNotFound, NotReplicated) as exc:
            # This worker cannot do the turn, the run is fine: give it back for a worker that can.
            if isinstance(exc, AgentNotFound) and _agent_unloadable_too_long(r, keys, settings):
                return _stop_unloadable(r, keys, token, settings, exc)
            return _hand_back(r, keys, got, token, exc, job_id, model_called=work.responded)
        except (UnreadableRecord, LedgerMismatch) as exc:
            log.error("run %s turn %s failed: %s", run_id, turn, exc)
            checkpoint.finish(
                r,
                keys,
                token,
                status="failed",
                error=str(exc),
                retention_s=settings.retention,
                event=Event.of(run_id, "status", status="failed", error=str(exc)),
                pool_webhook=settings.pool_webhook,
            )
            return "failed"
        except JobTimeoutException:
            # AGENTPOOL_TURN_TIMEOUT (the forking worker's hard limit on a runaway turn) cut it where it
            # stood: retried as a crash, it would run as long again, up to MAX_TURN_ATTEMPTS times. The
            # run stops instead, resumable; a resume settles what the cut turn left pending as a
            # takeover would.
            reason = f"turn {turn} ran past AGENTPOOL_TURN_TIMEOUT ({settings.turn_timeout:g} s)"
            log.error("run %s: %s; stopped", run_id, reason)
            return work.end("stopped", f"{reason}; resume it to go on from its checkpoint")
        except BaseException:
            # A bug, a lost Redis, a shutdown: give the turn back; the reaper re-enqueues it shortly.
            release(r, keys, token, recheck_in_ms=CRASH_RECHECK_MS)
            raise
        finally:
            work.give_back_prereserved()
            work.release_slot()


def _ended_for_good(got: AcquireResult) -> bool:
    """The lease was refused because the run is gone, or ended in a status no message or resume takes
    back to this turn: no attempt of it will call the model."""
    return got.code is Acquire.NO_RUN or (got.code is Acquire.NOT_ACTIVE and got.detail in ("failed", "cancelled"))


def _hand_back(
    r: Redis, keys: RunKeys, got: AcquireResult, token: str, exc: Exception, job_id: str, *, model_called: bool = False
) -> str:
    """Give the turn back (see ``agentpool.store.handback``), with one clear log line and no traceback:
    RQ sees a job that ended normally, so its failed count does not grow with every hand-back."""
    reason = next(name for kind, name in HANDED_BACK if isinstance(exc, kind))
    # The turn_started the acquire counted is taken back if no turn happened (the event stays in the
    # stream). Once save point A committed the model's reply (``model_called``) the turn did happen: its
    # retry only settles the tools and counts no turn start, so taking this one back would leave the
    # turns counted behind the model calls paid for.
    taken_back = got.recorded and not model_called
    counters = {f"handbacks|reason={reason}": 1.0, **({"turns": -1.0} if taken_back else {})}
    event = Event(
        keys.run_id, "handed_back", {"reason": reason, "worker": worker_identity(), "error": str(exc)}, counters
    )
    record = handback.hand_back(
        r, keys, token=token, reason=reason, detail=str(exc), worker=worker_identity(), job=job_id, event=event
    )
    if record is None:
        log.warning("run %s: not handed back (%s): the lease moved on, or the run has ended", keys.run_id, exc)
        return "abandoned"
    log.warning(
        "run %s: handed back (%s): %s; it waits %.0f s for a worker that can take it",
        keys.run_id,
        reason,
        exc,
        max(0.0, record.until - time.time()),
    )
    return "handed_back"


def _wait_for_earlier_attempt(r: Redis, keys: RunKeys, token: str, wait: EarlierAttemptMayRun, job_id: str) -> str:
    """Give the turn back until a call's earlier attempt can no longer take effect: the lease is
    dropped and the reaper (in every worker) re-enqueues the turn then, without counting an attempt or
    a takeover. No worker waits, and unlike a scheduled job this needs no RQ scheduler."""
    event = Event.of(keys.run_id, "waiting_for_call", until=round(wait.until, 3))
    record = handback.hand_back(
        r,
        keys,
        token=token,
        reason="earlier_attempt",
        detail=str(wait),
        worker=worker_identity(),
        job=job_id,
        until=wait.until,
        event=event,
    )
    if record is None:
        return "abandoned"
    log.info("run %s: given back for %.1f s: %s", keys.run_id, max(0.0, wait.until - time.time()), wait)
    return "deferred"


def _agent_unloadable_too_long(r: Redis, keys: RunKeys, settings: Settings) -> bool:
    """True once no worker could load the run's agent for ``agent_load_grace`` seconds in a row."""
    record = handback.read(r, keys)
    return bool(
        record and record.reason == "agent_not_loadable" and time.time() - record.since >= settings.agent_load_grace
    )


def _stop_unloadable(r: Redis, keys: RunKeys, token: str, settings: Settings, exc: AgentNotFound) -> str:
    reason = (
        f"no worker could load the agent for {settings.agent_load_grace:g} s (AGENTPOOL_AGENT_LOAD_GRACE): {exc}. "
        "Deploy code that has it (workers import agent code when they start) and resume the run"
    )
    checkpoint.finish(
        r,
        keys,
        token,
        status="stopped",
        error=reason,
        event=Event.of(keys.run_id, "status", status="stopped", error=reason),
        pool_webhook=settings.pool_webhook,
    )
    log.error("run %s: stopped: %s", keys.run_id, reason)
    return "stopped"


class Turn:
    def __init__(
        self,
        r: Redis,
        keys: RunKeys,
        token: str,
        turn: int,
        settings: Settings,
        *,
        window_from: int | None = None,
        job: Job | None = None,
    ) -> None:
        self.r, self.keys, self.token, self.turn, self.settings = r, keys, token, turn, settings
        self.job = job  # the RQ job the turn runs in (None: called outside RQ); save point B can end it
        self.window_from = window_from  # where the messages were read from with the lease (None: the header's)
        self.run_id = keys.run_id
        self.where = f"run {self.run_id} turn {turn}"
        self.started = time.monotonic()
        self.tools = Settlement(r, keys, token, turn, settings)
        self.watched = False  # somebody watches the run live (looked up with the lease)
        self.responded = False  # save point A committed this turn's model reply
        self.slot_key = ""  # the concurrency key whose slot this turn holds
        self.ancestors: list[str] = []  # a child run's ancestors: its calls' spend counts in their trees
        self.noted_call = ""  # the API's id for this turn's latest model call, once its reply began
        self.noted_usage: dict[str, int] = {}  # and the usage its note gave: what a takeover counts of it
        self.settles: list[Rider] = []  # the model calls' rate-limit settles not sent yet (settle_later)
        # The call reserved with the lease and what the budget answered, until a call takes it.
        self.prereserved: (
            tuple[ratelimit.ReserveRequest, ratelimit.Reservation | ratelimit.Wait | ratelimit.Unlimited] | None
        ) = None
        # The model call this turn last reserved, or was about to: (model, input tokens, output tokens).
        self.call_ahead: tuple[str, int, int] | None = None

    def run(
        self, header: dict[bytes, bytes], loaded: list[Any], watched: bool = False, noted: bytes | None = None
    ) -> str:
        """The turn, given the run's header and window (``store.window``) as read with the lease, and the
        note of the run's last billed call (``spend.note_call``)."""
        state = window.decode(self.run_id, header, loaded, start=self.window_from)
        remember_queue(self.run_id, state.queue)  # its next turn, or this one deferred, goes back there
        self.ancestors = state.ancestors
        self.watched = watched
        if lost := spend.lost_call(noted, state.last_call):
            self.count_lost_call(*lost)
        if state.concurrency_key:
            slot = concurrency.acquire(self.r, state.concurrency_key, self.run_id, state.max_concurrency, self.token)
            if not slot.granted:
                return self.wait_for_slot(state, slot)
            self.slot_key = state.concurrency_key if slot.limited else ""
        agent = load_agent(state.agent)
        self.tools.state = state
        if state.phase == "tools":
            emit(self.r, self.run_id, "resumed", turn=self.turn, pending=len(state.pending))
            with tracing.span(
                "agentpool.reconcile", **{"agentpool.run.id": self.run_id, "agentpool.pending": len(state.pending)}
            ):
                results = self.tools.settle(agent, state.pending, turns=state.turns)  # may raise EarlierAttemptMayRun
            if results is None:
                return self.tools.waiting
            return self.after_tools(
                results, turns=state.turns, window_at=compaction.window_hint(state), window_from=state.window_start
            )
        limits = Limits.of(agent, state.limits)
        reason = limits.reached(agent, state)
        if reason:
            return self.stop(reason, limits)
        if state.ancestors and (held := tree.hold_if_spent(self, state, limits)):
            return held  # an ancestor's budget for the tree is used up: stopped, held, until it is resumed
        fault("before_model_call", self.run_id, self.turn)
        try:
            state, reply = compaction.call(self, agent, state)
        except WaitForBudget as wait:
            return self.wait_for_budget(state, wait)
        except ModelUnavailable as exc:
            self.count_cut_stream(agent, exc)
            return self.defer(state, exc)
        except ModelQuotaExhausted as exc:
            return self.stop(str(exc))
        except ContextTooLong as exc:
            return self.stop(_context_full(agent, str(exc)))
        except ModelRejected as exc:
            if exc.spent:  # refused midway through its stream, after message_start: billed all the same
                self.count_unused_call(agent.model, exc.spent, "rejected")
            return self.end("failed", f"the model API rejected the request: {exc}")
        else:
            fault("after_model_reply", self.run_id, self.turn)
            return self.handle_reply(agent, state, reply, seconds=reply.seconds)
        finally:
            self.send_settles()  # what no save point A carried: the turn ended before one, or it failed

    def settle_later(self, call: Rider) -> None:
        """A model call's rate-limit settle (``agentpool.runtime.ratelimit``): it goes with save point A,
        a round trip the turn makes right after the call anyway, instead of one of its own."""
        self.settles.append(call)

    def send_settles(self) -> None:
        """Send, each on its own, the settles no save point A carried, and say which failed: the budget is
        corrected by its own refill, and the call's outcome matters more than this."""
        calls, self.settles = self.settles, []
        for call in calls:
            if call.sent:
                if isinstance(call.reply, Exception):
                    log.error("%s: could not settle a rate-limit reservation: %s", self.where, call.reply)
                continue
            try:
                call.run(self.r)
            except Exception:
                log.exception("%s: could not settle a rate-limit reservation", self.where)

    def take_prereserved(self, model: str) -> ratelimit.Reservation | ratelimit.Wait | ratelimit.Unlimited | None:
        """What the budget answered the lease for this turn's call of ``model``, for the first call that
        asks (None for the others, and for a call of another model)."""
        if self.prereserved is None or self.prereserved[0].model != model:
            return None
        (request, answer), self.prereserved = self.prereserved, None
        self.note_reserved(model, request.need)
        return answer

    def note_reserved(self, model: str, need: ratelimit.Need) -> None:
        """The call this turn reserves: should the turn be deferred (a wait for the budget or a slot, a
        model error's backoff), its next attempt's job carries it, for that attempt's lease to reserve."""
        self.call_ahead = (model, need.input, need.output)

    def call_to_carry(self) -> tuple[str, int, int] | None:
        """The call a deferred attempt of this turn is to reserve with its lease (``note_reserved``): the one
        the lease reserved if no call took it yet, else the last one this turn reserved; None if none."""
        if self.prereserved is not None:
            request = self.prereserved[0]
            return request.model, request.need.input, request.need.output
        return self.call_ahead

    def stage_deferred(self, state: RunState, pipe: Any, n: int, delay: float) -> None:
        """Record the turn as deferred for ``delay`` seconds, the run's ``n``-th re-enqueue, with what its
        job is to carry: where the run's window starts and the call it is to make."""
        stage_turn(
            pipe, self.r, self.run_id, self.turn, n, delay=delay, window=state.window_start, call=self.call_to_carry()
        )

    def give_back_prereserved(self) -> None:
        """The turn ends without the call reserved with its lease (it stopped, waited for a slot, lost its
        lease, another model was called): the budget gets it back, its request included, and a place in
        line it took is left."""
        if self.prereserved is None:
            return
        (request, answer), self.prereserved = self.prereserved, None
        try:
            if isinstance(answer, ratelimit.Wait):
                ratelimit.leave_line(self.r, request.model, request.ticket)
            elif isinstance(answer, ratelimit.Reservation) or answer.started:
                ratelimit.settle_call(
                    request.model,
                    reservation=answer,
                    used_input=0,
                    used_output=0,
                    reported=ratelimit.Reported(),
                    limits=configured_limits(self.settings, request.model),
                    minute_s=self.settings.rate_limit_minute,
                    never_called=True,
                ).run(self.r)
        except Exception:
            # The budget is corrected by its own refill, and a ticket expires: nothing else depends on it.
            log.exception("%s: could not give back the call reserved with the lease", self.where)

    def live_output(self, purpose: str) -> LiveOutput:
        """Where a model call of this turn streams for watchers (``purpose``: ``reply`` or ``summary``)."""
        return LiveOutput(self.r, self.keys, turn=self.turn, watched=self.watched, purpose=purpose)

    def count_cut_stream(self, agent: Agent, exc: ModelUnavailable) -> None:
        """A stream cut midway was billed for the tokens it reported: count them (its output is dropped)."""
        if exc.spent:
            self.count_unused_call(agent.model, exc.spent, exc.kind)
            fault("after_partial_spend", self.run_id, self.turn)

    def count_unused_call(self, model: str, usage: dict[str, int], why: str, *, call_id: str = "") -> None:
        """Count the tokens of a call whose output is not kept (a ``model_cut`` event says ``why``):
        ``call_id`` (by default this turn's last call), which no takeover must count again."""
        own = not call_id
        call_id = call_id or self.noted_call
        price = price_of(model)
        cost = price.cost(usage) if price else 0.0
        try:
            spend.count_spend(
                self.r,
                self.keys,
                self.token,
                spend_id=f"call:{call_id}" if call_id else uuid.uuid4().hex,
                usage=usage,
                cost_usd=cost,
                ancestors=self.ancestors,
                event=Event.of(
                    self.run_id, "model_cut", turn=self.turn, error_type=why, cost_usd=round(cost, 8), **usage
                ),
                rest=self.rest_of_call(model, call_id, usage) if own else None,
            )
        except LeaseLost:
            fault("after_spend_refused", self.run_id, self.turn)
            raise
        if call_id:
            spend.forget_call(self.r, self.keys, call_id)

    def rest_of_call(self, model: str, call_id: str, usage: Mapping[str, int]) -> spend.Rest | None:
        """What this worker knows of its call ``call_id`` beyond the note it made as the reply began
        (``note_call``: what a turn that took the run over would count of it), the output written after
        the note mostly: given with the call's save, which counts it, once, with a ``spend_corrected``
        event, if that takeover did count the call. None when there is nothing more to know."""
        if not call_id or call_id != self.noted_call:
            return None  # not the call this worker noted: what a takeover counted of it is not known here
        noted = self.noted_usage
        rest = {name: max(0, int(usage.get(name) or 0) - int(noted.get(name) or 0)) for name in USAGE_FIELDS}
        if not any(rest.values()):
            return None
        price = price_of(model)
        cost = max(0.0, price.cost(usage) - price.cost(noted)) if price else 0.0
        event = Event.of(self.run_id, "spend_corrected", turn=self.turn, call=call_id, cost_usd=round(cost, 8), **rest)
        return spend.Rest(call_id, rest, cost, event)

    def count_lost_call(self, call_id: str, model: str, usage: dict[str, int]) -> None:
        """An earlier attempt's worker died during a call it had noted as billed (or after its reply,
        before save point A): counted once (its id is the spend id), as far as the note says."""
        log.warning("%s: counting call %s, billed to a worker that died before saving it", self.where, call_id)
        self.count_unused_call(model, usage, "worker_lost", call_id=call_id)

    def note_call(self, agent: Agent) -> Callable[[str, dict[str, int]], None]:
        """What a model call of this turn tells once its reply begins: the note a takeover counts."""

        def noted(call_id: str, usage: dict[str, int]) -> None:
            self.noted_call, self.noted_usage = call_id, dict(usage)
            try:
                spend.note_call(self.r, self.keys, call_id=call_id, model=agent.model, usage=usage)
            except RedisError as exc:  # the call goes on; only a crash before its save would go uncounted
                log.warning("%s: could not note call %s as billed: %s", self.where, call_id, exc)

        return noted

    def handle_reply(self, agent: Agent, state: RunState, reply: ModelReply, seconds: float) -> str:
        tool_uses = [b for b in reply.message["content"] if b.get("type") == "tool_use"]
        pending = [{"id": b["id"], "name": b["name"], "input": b.get("input")} for b in tool_uses]
        stop = reply.stop_reason
        failure = FAILED_STOPS.get(stop) or (
            None
            if stop in FINISHED_STOPS + CONTINUE_STOPS + ("tool_use", OVERFLOW)
            else f"unknown stop_reason {stop!r}"
        )
        if pending and stop in ("max_tokens", OVERFLOW) and reply.message["content"][-1].get("type") == "tool_use":
            limit = f"max_tokens={agent.max_tokens}" if stop == "max_tokens" else "the model's context window"
            pending[-1]["not_run"] = (
                f"This call was cut off by {limit} and was not executed; its input may be "
                "incomplete. Call it again with a shorter input if it is still needed."
            )
        final = ""
        result = ""
        closing = None
        if stop == OVERFLOW and agent.compaction_mode is None:
            # Nothing can continue this conversation until compaction is on: the run stops (resumable),
            # decided in save point A for the same reason as a failure below.
            failure = _context_full(agent, "stop_reason: model_context_window_exceeded")
        if failure:
            # The run ends here, decided in save point A itself: a takeover after A must find it ended,
            # never a turn whose tool_uses it should settle and then call the model again. Its tool_uses
            # are answered as not run, so the conversation stays valid.
            final = "stopped" if stop == OVERFLOW else "failed"
            results = [Outcome(f"Not executed: {failure}.", True).as_tool_result(call["id"]) for call in pending]
            closing = _results_message(results)
            pending = []
        elif not pending and stop in FINISHED_STOPS:
            final = "completed"
            result = _trailing_text(state.messages + [reply.message])
        price = price_of(agent.model)
        cost = price.cost(reply.usage) if price else 0.0
        # A completed run keeps the limits it was held to: a message sent to it when it completed at one
        # is refused (agentpool.conversation), as for a run a limit stopped.
        held_to = Limits.of(agent, state.limits).limit_fields() if final == "completed" else {}
        # And the call a message sent to it will make, for the lease of the turn it queues to reserve
        # (as save point B's job carries it): its client does not load the agent.
        after = next_call(self, agent, reply.meta.get("context_tokens") or 0, []) if final == "completed" else None
        # The read calls that run as soon as the reply is committed get their intents in that very write.
        started = self.tools.start_reads(agent, pending) if pending and not final else []

        # What a turn that took the run over would not know of this call (counted only if it did).
        rest = self.rest_of_call(agent.model, str(reply.meta.get("id") or ""), reply.usage)

        def commit(final: str) -> None:
            if (
                checkpoint.commit_response(
                    self.r,
                    self.keys,
                    self.token,
                    turns_before=state.turns,
                    message=reply.message,
                    meta=reply.meta,
                    pending=pending,
                    final_status=final,
                    result=result,
                    error=failure or "",
                    retention_s=self.settings.retention if final in TERMINAL_STATUSES else 0,
                    usage=reply.usage,
                    cost_usd=cost,
                    closing=closing,
                    ancestors=state.ancestors,
                    late=late_answer(state, result) if final == "completed" else None,
                    responded=Event.of(
                        self.run_id,
                        "model_responded",
                        turn=self.turn,
                        message=state.window_start + len(state.messages),  # where the reply is saved
                        stop_reason=reply.stop_reason,
                        seconds=round(seconds, 4),
                        cost_usd=round(cost, 8),
                        compacted="server" if reply.compacted else None,
                        **reply.usage,
                    ),
                    event=Event.of(
                        self.run_id,
                        "status",
                        status=final,
                        error=failure,
                        **held_to,
                        next_call=call_field(after) if after else None,
                    )
                    if final
                    else Event.of(self.run_id, "response_committed", turn=self.turn, tool_uses=len(pending)),
                    pool_webhook=self.settings.pool_webhook,
                    intents=started if not final else (),
                    clear_handback=requeued(self.job),
                    riders=[call for call in self.settles if not call.sent],
                    window=compaction.window_hint(state, reply),
                    rest=rest,
                )
                == 2
            ):
                fault("after_last_child_end", self.run_id, self.turn)
                wake_parent_of(self.r, self.run_id)  # this child run was its parent's last open one

        try:
            with tracing.span("agentpool.save_point A", **{"agentpool.run.id": self.run_id, "agentpool.status": final}):
                commit(final)
        except (LeaseLost, RunNotActive, TurnMoved):
            # Refused, with the call counted all the same (it was paid for, by this write or, from its
            # note, by the turn that took the run over, and its rest by this write): no takeover counts
            # it again.
            fault("after_spend_refused", self.run_id, self.turn)
            spend.forget_call(self.r, self.keys, str(reply.meta.get("id") or ""))
            raise
        except MessagesWaiting:
            # Messages were sent while the model answered: the run answers them before it completes
            # (this turn's save point B delivers them; save point A wrote nothing).
            fault("after_delivery_refused", self.run_id, self.turn)
            final = ""
            commit(final)
        self.responded = True
        fault("after_save_a", self.run_id, self.turn)
        if final:
            return final
        tracing.tools_phase()  # the model call and save point A exported before a tool can kill the horse
        stats.hand_over()  # and counted
        # A child started now gets what is left after this very call (save point A counted it).
        self.tools.state = replace(
            state,
            usage={k: v + int(reply.usage.get(k) or 0) for k, v in state.usage.items()},
            cost_usd=state.cost_usd + cost,
        )
        results = self.tools.settle(agent, pending, turns=state.turns + 1, fresh=True) if pending else []
        if results is None:
            return self.tools.waiting
        return self.after_tools(
            results,
            turns=state.turns + 1,
            window_at=compaction.window_hint(state, reply),
            window_from=state.window_start,
            call=next_call(self, agent, reply.meta.get("context_tokens") or 0, _added_after(results)),
        )

    # -- ends of a turn ----------------------------------------------------------------------

    def after_tools(
        self,
        results: list[dict[str, Any]],
        *,
        turns: int,
        window_at: int | None = None,
        window_from: int = 0,
        call: tuple[str, int, int] | None = None,
    ) -> str:
        """Save point B, then the next turn (numbered by the turns counted so far) is queued; ``window_at``
        moves the run's window to a compaction block this turn's reply brought. The next turn's job
        carries where its window starts (``window_at``, or this turn's ``window_from``) and ``call``, what
        its model call will need (``runtime.ratelimit.next_call``)."""
        job = turn_job(self.r, self.run_id, turns, window=window_from if window_at is None else window_at, call=call)
        if window_at is not None:
            job = replace(job, header={**job.header, "window": window_at})
        with tracing.span(
            "agentpool.save_point B", **{"agentpool.run.id": self.run_id, "agentpool.tool_results": len(results)}
        ):
            checkpoint.commit_tool_results(
                self.r,
                self.keys,
                self.token,
                message=_results_message(results),
                next_job=job,
                outcomes=self.tools.outcomes,
                tool_events=self.tools.with_save_b,
                turns=turns,
                ended_job=ending_of(self.job),
                event=Event.of(
                    self.run_id,
                    "turn_committed",
                    turn=self.turn,
                    next_turn=turns,
                    tool_results=len(results),
                    seconds=round(time.monotonic() - self.started, 4),
                ),
            )
        if self.job is not None and ending_of(self.job) is not None:
            mark_ended(self.job)
        fault("after_save_b", self.run_id, self.turn)
        return "committed"

    def defer(self, state: RunState, exc: ModelUnavailable) -> str:
        errors = state.model_errors + 1
        delay = max(exc.retry_after or 0.0, random.uniform(0, min(120.0, 2.0 * 2 ** (errors - 1))))
        retrying = errors <= self.settings.model_retries
        # retry_at: when the deferred turn is due, so its lateness can be measured (agentpool.ops.lateness).
        retry_at = round(time.time() + delay, 3) if retrying else None
        emit(
            self.r,
            self.run_id,
            "model_error",
            turn=self.turn,
            error=str(exc),
            error_type=exc.kind,
            consecutive=errors,
            retry_at=retry_at,
        )
        if not retrying:
            return self.stop(f"the model API failed {errors} times in a row (last: {exc}); resume to try again")
        log.warning("%s: %s; retrying in %.1fs (%d/%d)", self.where, exc, delay, errors, self.settings.model_retries)
        checkpoint.defer_turn(
            self.r,
            self.keys,
            self.token,
            model_errors=errors,
            delay_ms=int(delay * 1000),
            enqueue_later=lambda pipe, n: self.stage_deferred(state, pipe, n, delay),
            reason=f"{exc.kind}: {exc}"[:500],
        )
        return "deferred"

    def wait_for_budget(self, state: RunState, wait: WaitForBudget) -> str:
        """Defer the turn until the pool's rate-limit budget can cover its call: no model error is
        counted (nothing failed), no worker waits, the lease is dropped."""
        log.info("%s: %s", self.where, wait)
        emit(
            self.r,
            self.run_id,
            "waiting_for_budget",
            turn=self.turn,
            model=wait.model,
            seconds=round(wait.seconds, 3),
            paused=True if wait.paused else None,  # after a 429 that taught nothing, not for the budget
        )
        checkpoint.defer_turn(
            self.r,
            self.keys,
            self.token,
            model_errors=state.model_errors,
            delay_ms=int(wait.seconds * 1000),
            enqueue_later=lambda pipe, n: self.stage_deferred(state, pipe, n, wait.seconds),
            reason=f"rate_limit_budget: {wait}"[:500],
        )
        return "deferred"

    def wait_for_slot(self, state: RunState, slot: concurrency.Slot) -> str:
        """Defer the turn until its concurrency key has a free slot: the turn that frees one wakes the
        first in line (its deferred entry made due now); ``SLOT_POLL`` is only the fallback."""
        key = state.concurrency_key
        emit(self.r, self.run_id, "waiting_for_slot", turn=self.turn, key=key, in_flight=slot.held, ahead=slot.ahead)

        def later(pipe: Any, n: int) -> None:
            self.stage_deferred(state, pipe, n, SLOT_POLL)
            expires = now_ms() + int((SLOT_POLL + SLOT_GRACE) * 1000)
            concurrency.stage_wake(pipe, key, self.run_id, deferred_member(self.run_id, self.turn, n), expires)

        checkpoint.defer_turn(
            self.r,
            self.keys,
            self.token,
            model_errors=state.model_errors,
            delay_ms=int(SLOT_POLL * 1000),
            enqueue_later=later,
            reason=f"concurrency: {key} has {slot.held} turn(s) in flight, {slot.ahead} waiting ahead",
        )
        try:  # a slot freed since the acquire woke nobody: this turn's wait was not recorded yet
            concurrency.wake_if_free(self.r, key, state.max_concurrency)
        except RedisError as exc:  # the wait's poll wakes it all the same
            log.warning("%s: could not look for a slot freed meanwhile: %s", self.where, exc)
        return "deferred"

    def release_slot(self) -> None:
        if not self.slot_key:
            return
        key, self.slot_key = self.slot_key, ""
        try:
            concurrency.release(self.r, key, self.run_id, self.token)
        except RedisError as exc:  # the slot frees itself once the lease is gone; the waiter's poll wakes it
            log.warning("%s: could not free its %s slot: %s", self.where, key, exc)

    def stop(self, reason: str, limits: Limits | None = None) -> str:
        # The limits it was held to go in the status event: resume checks what it adds against them.
        return self.end("stopped", reason, detail=limits.limit_fields() if limits else None)

    def end(
        self, status: str, reason: str, message: dict[str, Any] | None = None, detail: dict[str, Any] | None = None
    ) -> str:
        woke = checkpoint.finish(
            self.r,
            self.keys,
            self.token,
            status=status,
            error=reason,
            message=message,
            phase="done" if message else "",
            retention_s=self.settings.retention,
            event=Event.of(self.run_id, "status", status=status, error=reason, **(detail or {})),
            pool_webhook=self.settings.pool_webhook,
        )
        if woke == 2:
            fault("after_last_child_end", self.run_id, self.turn)
            wake_parent_of(self.r, self.run_id)
        log.info("%s: %s: %s", self.where, status, reason)
        return status


def _context_full(agent: Agent, detail: str) -> str:
    if agent.compaction_mode is None:
        return (
            f"the conversation no longer fits the model's context window ({detail}); turn compaction on "
            "(Agent(compaction=True)) and resume the run: it goes on from a summary of what came before"
        )
    return (
        f"the request is longer than the model's context window, and compaction could not shorten it "
        f"enough ({detail}): nothing before the last message to summarize, or what is left after the "
        "summary is still too long; lower the agent's Compaction(trigger=...) or shorten its tool results "
        "or messages, and resume the run"
    )


def _added_after(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages save point B adds after the reply: what the next call sends beyond this one's context."""
    message = _results_message(results)
    return [message] if message else []


def _results_message(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    return {"role": "user", "content": results} if results else None
