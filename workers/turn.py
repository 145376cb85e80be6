"""One RQ job = one agent turn: reconcile what a dead worker left, call the model, run the tools.

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
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from dataclasses import replace
from typing import Any

from redis import Redis
from rq import get_current_job

from store import approvals, checkpoint, ledger
from store.clock import now_ms
from store.crypto import EncryptionKeyMissing
from store.errors import LeaseLost, LedgerMismatch, RunNotActive, SchemaTooNew, UnreadableRecord
from store.events import Event, emit
from store.keys import RunKeys
from store.lease import Acquire, acquire, release
from store.ledger import Entry, Outcome
from store.records import RunState
from workers.agent import Agent, AgentNotFound, load_agent
from workers.context import ToolCall
from workers.faults import fault
from workers.heartbeat import keep_alive
from workers.jobs import stage_turn
from workers.limits import Limits
from workers.model import ModelQuotaExhausted, ModelRejected, ModelReply, ModelUnavailable, call_model
from workers.pricing import price_of
from workers.reconcile import Action, idempotency_key, plan, unknown_outcome
from workers.settings import Settings, connect
from workers.toolcall import run_tool
from workers.tools import Tool, ToolInputError

log = logging.getLogger("agentpool.turn")

FINISHED_STOPS = ("end_turn", "stop_sequence")
CONTINUE_STOPS = ("pause_turn", "max_tokens")  # continue with no new user message
FAILED_STOPS = {
    "refusal": "the model declined to continue (stop_reason: refusal)",
    "model_context_window_exceeded": "the conversation no longer fits the model's context window",
}
# After an unexpected error, the turn is re-enqueued by the reaper after this pause.
CRASH_RECHECK_MS = 5_000


def worker_identity() -> str:
    """``<rq worker name>.<pid>``: the worker's parent can release the lease of a horse it saw die."""
    return f"{os.environ.get('RQ_WORKER_ID') or socket.gethostname()}.{os.getpid()}"


def run_turn(run_id: str, turn: int) -> str:
    """The RQ job function. Returns a one-word summary RQ keeps briefly; the checkpoint is the truth."""
    job = get_current_job()
    r = job.connection if job is not None else connect()
    settings = Settings.from_env()
    keys = RunKeys.of(run_id)
    # One round trip takes the lease (recording turn_started) and reads the run it now owns.
    got = acquire(r, keys, turn=turn, worker_id=worker_identity(), ttl_ms=settings.lease_ttl_ms,
                  event=Event.of(run_id, "turn_started", turn=turn), then=lambda pipe: checkpoint.stage_load(pipe, run_id))
    if got.code is Acquire.TOO_NEW:
        raise SchemaTooNew(f"run {run_id} has schema version {got.detail}, newer than this worker; left untouched")
    if got.code is Acquire.UNREADABLE:
        checkpoint.fail_unfenced(r, run_id, f"run header field {got.detail!r} is unreadable; data left as found")
        return "unreadable"
    if got.code is not Acquire.ACQUIRED:
        log.info("run %s turn %s: %s (%s); nothing to do", run_id, turn, got.code.name.lower(), got.detail)
        return got.code.name.lower()
    token = got.token
    with keep_alive(r, keys, token, settings.lease_ttl_ms):
        try:
            return Turn(r, keys, token, turn, settings).run(*got.then)
        except (LeaseLost, RunNotActive) as exc:
            log.warning("run %s turn %s: %s", run_id, turn, exc)
            return "abandoned"
        except EncryptionKeyMissing:
            # This worker is misconfigured, the run is fine: give it back for a worker with the key.
            release(r, keys, token, recheck_in_ms=CRASH_RECHECK_MS)
            raise
        except (UnreadableRecord, LedgerMismatch, AgentNotFound) as exc:
            log.error("run %s turn %s failed: %s", run_id, turn, exc)
            checkpoint.finish(r, keys, token, status="failed", error=str(exc), retention_s=settings.retention,
                              event=Event.of(run_id, "status", status="failed", error=str(exc)))
            return "failed"
        except BaseException:
            # A bug, a lost Redis, a shutdown: give the turn back; the reaper re-enqueues it shortly.
            release(r, keys, token, recheck_in_ms=CRASH_RECHECK_MS)
            raise


class Turn:
    def __init__(self, r: Redis, keys: RunKeys, token: str, turn: int, settings: Settings) -> None:
        self.r, self.keys, self.token, self.turn, self.settings = r, keys, token, turn, settings
        self.run_id = keys.run_id
        self.where = f"run {self.run_id} turn {turn}"
        self.started = time.monotonic()
        self.outcomes: dict[str, Outcome] = {}  # settled this turn, compacted in the ledger at save point B

    def run(self, header: dict[bytes, bytes], blobs: list[bytes]) -> str:
        """The turn, given the run's header and messages as read with the lease."""
        state = checkpoint.decode_run(self.run_id, header, blobs)
        agent = load_agent(state.agent)
        if state.phase == "tools":
            emit(self.r, self.run_id, "resumed", turn=self.turn, pending=len(state.pending))
            results = self.settle(agent, state.pending)
            if results is None:
                return "waiting_approval"
            return self.after_tools(results, turns=state.turns)
        reason = Limits.of(agent, state.limits).reached(agent, state)
        if reason:
            return self.stop(reason)
        fault("before_model_call", self.run_id, self.turn)
        asked = time.monotonic()
        try:
            reply = call_model(agent, state.messages)
        except ModelUnavailable as exc:
            return self.defer(state, exc)
        except ModelQuotaExhausted as exc:
            return self.stop(str(exc))
        except ModelRejected as exc:
            return self.end("failed", f"the model API rejected the request: {exc}")
        fault("after_model_reply", self.run_id, self.turn)
        return self.handle_reply(agent, state, reply, seconds=time.monotonic() - asked)

    def handle_reply(self, agent: Agent, state: RunState, reply: ModelReply, seconds: float) -> str:
        tool_uses = [b for b in reply.message["content"] if b.get("type") == "tool_use"]
        pending = [{"id": b["id"], "name": b["name"], "input": b.get("input")} for b in tool_uses]
        stop = reply.stop_reason
        failure = FAILED_STOPS.get(stop) or (
            None if stop in FINISHED_STOPS + CONTINUE_STOPS + ("tool_use",) else f"unknown stop_reason {stop!r}"
        )
        if pending and stop == "max_tokens" and reply.message["content"][-1].get("type") == "tool_use":
            pending[-1]["not_run"] = (
                f"This call was cut off by max_tokens={agent.max_tokens} and was not executed; its input may be "
                "incomplete. Call it again with a shorter input if it is still needed."
            )
        if failure:
            for call in pending:
                call.setdefault("not_run", f"Not executed: {failure}.")
        final = ""
        result = ""
        if not pending and (stop in FINISHED_STOPS or failure):
            final = "failed" if failure else "completed"
            result = _trailing_text(state.messages + [reply.message])
        price = price_of(agent.model)
        cost = price.cost(reply.usage) if price else 0.0
        checkpoint.commit_response(
            self.r, self.keys, self.token,
            turns_before=state.turns, message=reply.message, meta=reply.meta, pending=pending,
            final_status=final, result=result, error=failure or "", retention_s=self.settings.retention,
            usage=reply.usage, cost_usd=cost,
            responded=Event.of(self.run_id, "model_responded", turn=self.turn, stop_reason=reply.stop_reason,
                               seconds=round(seconds, 4), cost_usd=round(cost, 8), **reply.usage),
            event=Event.of(self.run_id, "status", status=final, error=failure) if final else
            Event.of(self.run_id, "response_committed", turn=self.turn, tool_uses=len(pending)),
        )
        fault("after_save_a", self.run_id, self.turn)
        if final:
            return final
        results = self.settle(agent, pending, fresh=True) if pending else []
        if results is None:
            return "waiting_approval"
        if failure:
            return self.end("failed", failure, message=_results_message(results))
        return self.after_tools(results, turns=state.turns + 1)

    # -- tools -------------------------------------------------------------------------------

    def settle(self, agent: Agent, pending: list[dict[str, Any]], *, fresh: bool = False) -> list[dict[str, Any]] | None:
        """One tool_result per pending tool_use, in order, each reconciled on its own; or None when
        the run now waits for a person's decision on some of them. ``fresh`` calls come from the reply
        this very turn received: nothing can be recorded for them yet, so the ledger is not read."""
        if fresh:
            entries = {call["id"]: Entry(None, None) for call in pending}
        else:
            entries = ledger.read(self.r, self.keys, [call["id"] for call in pending])
            for call in pending:
                ledger.check_same_call(entries[call["id"]], call)
        gated = any((tool := agent.tool_named(call["name"])) and tool.requires_approval for call in pending)
        decisions = approvals.read(self.r, self.keys)[1] if gated else {}
        undecided = [call for call in pending if self.needs_decision(agent, call, entries[call["id"]], decisions)]
        if undecided:
            self.wait_for_approval(agent, undecided)
            return None
        return [self.settle_one(agent, call, entries[call["id"]], decisions.get(call["id"])).as_tool_result(call["id"])
                for call in pending]

    def needs_decision(self, agent: Agent, call: dict[str, Any], entry: Entry,
                       decisions: dict[str, approvals.Decision]) -> bool:
        tool = agent.tool_named(call["name"])
        # Only a call that would now start needs one: not a recorded outcome, not an unsafe call in
        # doubt (that one is never started again), not a call already refused for another reason.
        return bool(tool and tool.requires_approval and entry.outcome is None and entry.intent is None
                    and "not_run" not in call and call["id"] not in decisions)

    def wait_for_approval(self, agent: Agent, calls: list[dict[str, Any]]) -> None:
        """Before any intent is written: record what a person must decide, and release the run.
        Nothing is queued or leased while it waits; the reaper denies a call once its deadline passes."""
        now = time.time()
        deadlines = []
        for call in calls:
            tool = agent.tool_named(call["name"])
            timeout = (tool.approval_timeout if tool and tool.approval_timeout is not None else agent.approval_timeout)
            deadline = now + timeout if timeout is not None else None
            deadlines += [deadline] if deadline is not None else []
            approvals.request(self.r, self.keys, self.token, call, now=now, deadline=deadline)
        checkpoint.finish(self.r, self.keys, self.token, status="waiting_approval", error="",
                          watch_at_ms=int(min(deadlines) * 1000) if deadlines else None,
                          event=Event.of(self.run_id, "status", status="waiting_approval",
                                         tools=",".join(call["name"] for call in calls)))

    def settle_one(self, agent: Agent, call: dict[str, Any], entry: Entry,
                   decision: approvals.Decision | None = None) -> Outcome:
        if entry.outcome is not None:
            emit(self.r, self.run_id, "reconciled", tool=call["name"], tool_use_id=call["id"], outcome="replayed")
            self.outcomes[call["id"]] = entry.outcome
            return entry.outcome
        if "not_run" in call:
            return self.record(call, Outcome(call["not_run"], True), how="not_run")
        tool = agent.tool_named(call["name"])
        if tool is None and entry.intent is None:
            names = ", ".join(t.name for t in agent.tools) or "none"
            return self.record(call, Outcome(f"There is no tool named {call['name']!r}. Tools: {names}.", True), how="unknown_tool")
        action = plan(tool.effect if tool else None, entry, has_verify=bool(tool and tool.verify_fn))
        if entry.intent is not None:
            emit(self.r, self.run_id, "reconciling", tool=call["name"], tool_use_id=call["id"],
                 effect=tool.effect if tool else "?", action=action.value)
        if action is Action.UNKNOWN:
            return self.record(call, unknown_outcome(call["name"]), how="unknown")
        assert tool is not None
        try:
            kwargs = tool.validate(call["input"])
        except ToolInputError as exc:
            return self.record(call, Outcome(str(exc), True), how="invalid_input")
        if tool.requires_approval and entry.intent is None:
            refusal = self.check_decision(call, decision)
            if refusal is not None:
                return self.record(call, refusal, how="denied")
        key = idempotency_key(self.run_id, call["id"])
        if action is Action.VERIFY:
            verdict = self.verify(tool, kwargs, key)
            if verdict is None:
                return self.record(call, unknown_outcome(call["name"]), how="unknown")
            if verdict is not False:
                return self.record(call, Outcome(str(verdict), False), how="verified")
        return self.execute(agent, tool, call, kwargs, key, attempt=entry.attempts + 1)

    def execute(self, agent: Agent, tool: Tool, call: dict[str, Any], kwargs: dict[str, Any], key: str, attempt: int) -> Outcome:
        ledger.write_intent(self.r, self.keys, self.token, call, effect=tool.effect, attempt=attempt, now=now_ms() / 1000,
                            event=Event.of(self.run_id, "tool_started", tool=tool.name, tool_use_id=call["id"],
                                           effect=tool.effect, attempt=attempt))
        outcome = run_tool(
            tool, kwargs, call=ToolCall(self.run_id, self.turn, call["id"], key, attempt),
            timeout=tool.timeout or agent.tool_timeout, limit=agent.max_result_chars, where=self.where,
        )
        fault("in_tool", self.run_id, self.turn)
        self.record(call, outcome, how="ran", event=Event.of(self.run_id, "tool_finished", tool=tool.name,
                                                             tool_use_id=call["id"], effect=tool.effect,
                                                             is_error=outcome.is_error))
        fault("after_tool_outcome", self.run_id, self.turn)
        return outcome

    def check_decision(self, call: dict[str, Any], decision: approvals.Decision | None) -> Outcome | None:
        """None if a person approved exactly this call; otherwise the is_error outcome to record."""
        if decision is None or decision.input_digest != ledger.input_digest(call["input"]):
            raise LedgerMismatch(f"the approval on record for {call['id']} is missing or was given for other input")
        if decision.approved:
            return None
        who = "The approval request expired" if decision.by == "expiry" else "A person denied this call"
        return Outcome(f"{who}: {decision.reason or 'no reason given'}. It was not executed.", True)

    def verify(self, tool: Tool, kwargs: dict[str, Any], key: str) -> str | bool | None:
        assert tool.verify_fn is not None
        try:
            return tool.verify_fn(**kwargs, idempotency_key=key)
        except Exception as exc:
            log.warning("%s: verify hook of %s raised %s; treating the outcome as unknown", self.where, tool.name, exc)
            return None

    def record(self, call: dict[str, Any], outcome: Outcome, *, how: str, event: Event | None = None) -> Outcome:
        """The outcome in the ledger, with ``event`` (by default: how the call was settled without running)."""
        event = event or Event.of(self.run_id, "reconciled" if how in ("unknown", "verified") else "tool_skipped",
                                  tool=call["name"], tool_use_id=call["id"], outcome=how)
        ledger.write_outcome(self.r, self.keys, self.token, call["id"], outcome, how=how, now=now_ms() / 1000,
                             event=event)
        self.outcomes[call["id"]] = replace(outcome, how=how)
        return outcome

    # -- ends of a turn ----------------------------------------------------------------------

    def after_tools(self, results: list[dict[str, Any]], *, turns: int) -> str:
        """Save point B, then the next turn (numbered by the turns counted so far) is queued."""
        checkpoint.commit_tool_results(
            self.r, self.keys, self.token,
            message=_results_message(results),
            enqueue_next=lambda pipe: stage_turn(pipe, self.r, self.run_id, turns),
            outcomes=self.outcomes,
            event=Event.of(self.run_id, "turn_committed", turn=self.turn, next_turn=turns, tool_results=len(results),
                           seconds=round(time.monotonic() - self.started, 4)),
        )
        fault("after_save_b", self.run_id, self.turn)
        return "committed"

    def defer(self, state: RunState, exc: ModelUnavailable) -> str:
        errors = state.model_errors + 1
        emit(self.r, self.run_id, "model_error", turn=self.turn, error=str(exc), error_type=exc.kind, consecutive=errors)
        if errors > self.settings.model_retries:
            return self.stop(f"the model API failed {errors} times in a row (last: {exc}); resume to try again")
        delay = max(exc.retry_after or 0.0, random.uniform(0, min(120.0, 2.0 * 2 ** (errors - 1))))
        log.warning("%s: %s; retrying in %.1fs (%d/%d)", self.where, exc, delay, errors, self.settings.model_retries)
        checkpoint.defer_turn(
            self.r, self.keys, self.token, model_errors=errors, delay_ms=int(delay * 1000),
            enqueue_later=lambda pipe, attempt: stage_turn(pipe, self.r, self.run_id, self.turn, attempt, delay=delay),
        )
        return "deferred"

    def stop(self, reason: str) -> str:
        return self.end("stopped", reason)

    def end(self, status: str, reason: str, message: dict[str, Any] | None = None) -> str:
        checkpoint.finish(self.r, self.keys, self.token, status=status, error=reason, message=message,
                          phase="done" if message else "", retention_s=self.settings.retention,
                          event=Event.of(self.run_id, "status", status=status, error=reason))
        log.info("%s: %s: %s", self.where, status, reason)
        return status


def _results_message(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    return {"role": "user", "content": results} if results else None


def _trailing_text(messages: list[dict[str, Any]]) -> str:
    """The text of the assistant messages after the last user message (a paused or cut-off answer
    continues over several)."""
    parts: list[str] = []
    for message in reversed(messages):
        if message["role"] != "assistant":
            break
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        parts.insert(0, "".join(b.get("text", "") for b in blocks if b.get("type") == "text"))
    return "".join(parts)
