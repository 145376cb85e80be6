"""Settling a turn's tool_uses: one tool_result for each, reconciled against the ledger.

A call whose outcome is on record replays it; a call nobody started runs (after a person's decision,
if its tool needs one); a call started by a dead worker is decided by ``reconcile.plan``, once that
attempt can no longer be running (``reconcile.running_until``). Every step writes the ledger first
(an intent before the tool, an outcome after), fenced by the turn's lease, and every outcome goes
through ``toolcall.bounded`` on its way in: nothing a tool returns or raises can make a turn
unrecordable or oversized.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from redis import Redis

from agentpool.agent import Agent
from agentpool.context import ToolCall
from agentpool.runtime import durability, tracing, tree
from agentpool.runtime.faults import fault
from agentpool.runtime.limits import Limits
from agentpool.runtime.reconcile import Action, idempotency_key, plan, running_until, unknown_outcome
from agentpool.runtime.settings import Settings
from agentpool.runtime.subagents import Delegation, waiting_event, wake_parent_of
from agentpool.runtime.toolcall import Ownership, bounded, result_text, run_tool, run_verify
from agentpool.store import approvals, checkpoint, children, ledger, stats
from agentpool.store.clock import now_ms
from agentpool.store.codec import pack
from agentpool.store.durability import NotReplicated, Proof, wait_durable
from agentpool.store.errors import LedgerMismatch
from agentpool.store.events import Event, emit
from agentpool.store.keys import RunKeys
from agentpool.store.ledger import Entry, Outcome
from agentpool.store.records import RunState
from agentpool.tools import Tool, ToolInputError

log = logging.getLogger("agentpool.turn")


class EarlierAttemptMayRun(Exception):
    """A call's earlier attempt may still take effect until ``until`` (epoch seconds), further off
    than a turn waits in its worker: the turn is to be deferred until then."""

    def __init__(self, until: float) -> None:
        at = time.strftime("%H:%M:%S UTC", time.gmtime(until))  # read by people in `show`, not parsed
        super().__init__(f"an earlier attempt may still be running until {at}")
        self.until = until


class Settlement:
    """The tool calls of one turn, settled under the turn's lease ``token``."""

    def __init__(self, r: Redis, keys: RunKeys, token: str, turn: int, settings: Settings | None = None) -> None:
        self.r, self.keys, self.token, self.turn = r, keys, token, turn
        self.settings = settings or Settings.from_env()
        self.run_id = keys.run_id
        self.where = f"run {self.run_id} turn {turn}"
        self.limit = 100_000  # the agent's max_result_chars, once settle() is given the agent
        self.outcomes: dict[str, Outcome] = {}  # settled this turn, compacted in the ledger at save point B
        # A read tool's outcome is not written on its own: it goes into the ledger, with its tool_finished
        # event (these), in save point B's one call. A worker dying before then leaves the call started
        # with no outcome, and a read tool is run again then (DESIGN.md's table): no effect is repeated.
        self.with_save_b: list[Event] = []
        self._unwritten: dict[str, tuple[dict[str, Any], Outcome, Event]] = {}
        # Where the run is while its tools settle (turns counted, "tools"): every ledger write lands only
        # there, so none lands on a server that lacks the save point A that asked for the call.
        self.at: ledger.At | None = None
        self.state: RunState | None = None  # the run as the turn loaded it (sub-agent calls need it)
        self.waiting = "waiting_approval"  # what settle() returning None means the run waits for
        # The fresh read calls whose intents save point A wrote (``start_reads``): id -> their input as
        # validated then. Their tools run with no intent write of their own.
        self.started: dict[str, dict[str, Any]] = {}

    def start_reads(self, agent: Agent, pending: list[dict[str, Any]]) -> list[tuple[str, dict, Event]]:
        """The intents (tool_use id, record, ``tool_started`` event) of the calls in a reply that will run
        as soon as it is committed, for save point A to write with it (``checkpoint.commit_response``):
        read tools only, with valid input, and only when no call of the reply can make the turn wait (a
        person's decision, a sub-agent) before it runs them. The tool_started event then precedes the
        call by the commit's round trip, and a worker dying before the tool runs leaves an intent with no
        outcome, which for a read means "run it again" (``reconcile.plan``). Not for other effects:
        their intents must say when the call really started (``running_until``), and the durability
        guard waits for them before the call (``execute``)."""
        intents: list[tuple[str, dict, Event]] = []
        if any(
            agent.subagent_named(c["name"]) or getattr(agent.tool_named(c["name"]), "requires_approval", False)
            for c in pending
        ):
            return intents  # the turn may wait (a person, a child run) before any call runs: none starts now
        now = now_ms() / 1000
        for call in pending:
            tool = agent.tool_named(call["name"])
            if tool is None or tool.effect != "read" or "not_run" in call:
                continue
            try:
                kwargs = tool.validate(call["input"])
            except ToolInputError:
                continue  # settled as invalid_input, with no intent, when the tools settle
            record = ledger.intent_record(
                call, self.token, effect="read", attempt=1, now=now, timeout=self.timeout_of(tool, agent)
            )
            intents.append((call["id"], record, self.tool_event(tool, call, "tool_started", attempt=1)))
            self.started[call["id"]] = kwargs
        return intents

    def settle(
        self, agent: Agent, pending: list[dict[str, Any]], *, turns: int, fresh: bool = False
    ) -> list[dict[str, Any]] | None:
        """One tool_result per pending tool_use, in order, each reconciled on its own; or None when
        the run now waits for a person's decision on some of them. ``turns`` is the run's turn count
        with the save point A that recorded them. ``fresh`` calls come from the reply this very turn
        received: nothing can be recorded for them yet, so the ledger is not read.

        Raises ``EarlierAttemptMayRun`` when a call started by a worker that lost the lease may still
        take effect for longer than a turn waits in its worker (``wait_for_earlier_attempts``)."""
        self.limit = agent.max_result_chars
        self.at = (turns, "tools")
        if fresh:
            entries = {call["id"]: Entry(None, None) for call in pending}
        else:
            entries = ledger.read(self.r, self.keys, [call["id"] for call in pending])
            for call in pending:
                ledger.check_same_call(entries[call["id"]], call)
            self.wait_for_earlier_attempts(agent, pending, entries)
        delegated = self.delegate(agent, pending, entries)  # children first: they run while the rest settles
        gated = any((tool := agent.tool_named(call["name"])) and tool.requires_approval for call in pending)
        decisions = approvals.read(self.r, self.keys)[1] if gated else {}
        undecided = [call for call in pending if self.needs_decision(agent, call, entries[call["id"]], decisions)]
        if undecided:
            self.wait_for_approval(agent, undecided)
            return None
        settled = {
            call["id"]: self.traced(agent, call, entries[call["id"]], decisions.get(call["id"]))
            for call in pending
            if call["id"] not in delegated
        }
        if delegated:
            joined = self.join(pending, delegated)
            if joined is None:
                return None
            settled.update({call_id: outcome.as_tool_result(call_id) for call_id, outcome in joined.items()})
        return [settled[call["id"]] for call in pending]

    def traced(
        self, agent: Agent, call: dict[str, Any], entry: Entry, decision: approvals.Decision | None
    ) -> dict[str, Any]:
        """The call's tool_result, settled in an ``execute_tool`` span (when tracing is on) that says its
        effect class and how it was settled (ran, replayed, unknown, verified, denied, ...)."""
        tool = agent.tool_named(call["name"])
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call["name"],
            "gen_ai.tool.call.id": call["id"],
            "agentpool.tool.effect": tool.effect if tool else "?",
            "agentpool.tool.attempts": entry.attempts,
        }
        with tracing.span(f"execute_tool {call['name']}", **attributes) as span:
            outcome = self.settle_one(agent, call, entry, decision)
            settled = self.outcomes.get(call["id"])
            how = "replayed" if entry.outcome is not None or settled is None else settled.how
            decided = None if decision is None else ("approved" if decision.approved else "denied")
            tracing.set_attributes(
                span,
                **{
                    "agentpool.tool.outcome": how,
                    "agentpool.tool.is_error": outcome.is_error,
                    "agentpool.approval": decided,
                },
            )
            return outcome.as_tool_result(call["id"])

    def delegate(self, agent: Agent, pending: list[dict[str, Any]], entries: dict[str, Entry]) -> dict[str, Any]:
        """The sub-agent calls: call id -> the child run answering it (still to be joined), or the outcome
        already settled (on record, refused, not run)."""
        calls = [call for call in pending if agent.subagent_named(call["name"])]
        if not calls:
            return {}
        assert self.state is not None, "a turn gives its run's state before settling sub-agent calls"
        self.delegation = Delegation(self.r, self.keys, self.token, agent, self.state)
        out: dict[str, Any] = {}
        for index, call in enumerate(calls):
            entry = entries[call["id"]]
            if entry.outcome is not None:
                out[call["id"]] = self.settle_one(agent, call, entry)
            elif "not_run" in call:
                out[call["id"]] = self.record(call, Outcome(call["not_run"], True), how="not_run")
            elif (refusal := self.delegation.refusal(call, index)) is not None:
                out[call["id"]] = self.record(call, refusal, how="refused")
            else:
                out[call["id"]] = self.delegation.start(call)
        return out

    def join(self, pending: list[dict[str, Any]], delegated: dict[str, Any]) -> dict[str, Outcome] | None:
        """Every delegated call's outcome once its child has ended; None when the run now waits for
        children still running (``waiting_children``: nothing is leased; the last one's end wakes it)."""
        by_id = {call["id"]: call for call in pending}
        while True:
            running = []
            for call_id, child in delegated.items():
                if isinstance(child, Outcome):
                    continue
                outcome = self.delegation.outcome(by_id[call_id], child)
                if outcome is None:
                    running.append(by_id[call_id])
                    continue
                delegated[call_id] = self.record(
                    by_id[call_id],
                    outcome,
                    how="subagent",
                    event=Event.of(
                        self.run_id,
                        "child_joined",
                        tool=by_id[call_id]["name"],
                        tool_use_id=call_id,
                        child=child,
                        is_error=outcome.is_error,
                    ),
                )
            if not running:
                return delegated
            self.write_held_outcomes()  # the turn stops here (no save point B): the lease goes with the wait
            assert self.state is not None
            code = children.wait(
                self.r,
                self.keys,
                self.token,
                parent=self.state.parent,
                event=waiting_event(self.run_id, running),
                stopped=tree.wait_stop(self.run_id, Limits.of(self.delegation.agent, self.state.limits)),
                pool_webhook=self.settings.pool_webhook,
            )
            if code == 1:
                self.waiting = "waiting_children"
                return None
            if code in (2, 3):  # the tree's budget is used up: stopped with its children's joins kept
                self.waiting = "stopped"
                if code == 3:
                    wake_parent_of(self.r, self.run_id)
                return None
            # Every child ended between the look and the wait: read their ends and go on.

    def wait_for_earlier_attempts(self, agent: Agent, pending: list[dict[str, Any]], entries: dict[str, Entry]) -> None:
        """Before anything is asked or run: an attempt started by a worker that lost its lease (frozen
        by a GC pause or SIGSTOP, cut off by a partition) may still be inside its tool, and fencing
        cannot stop a thread already there. Wait until each such attempt can no longer be running: in
        this worker (lease kept alive) if that comes within one lease TTL, the time a takeover takes
        anyway; otherwise the turn is deferred (``EarlierAttemptMayRun``) and frees its worker."""
        waits = []
        for call in pending:
            tool = agent.tool_named(call["name"])
            until = running_until(
                tool.effect if tool else None,
                entries[call["id"]],
                has_verify=bool(tool and tool.verify_fn),
                timeout=self.timeout_of(tool, agent),
                margin=self.settings.takeover_margin,
            )
            if until > time.time():
                waits.append((until, call))
        if not waits:
            return
        until, call = max(waits, key=lambda w: w[0])
        seconds = until - time.time()
        deferred = seconds > self.settings.lease_ttl
        emit(
            self.r,
            self.run_id,
            "waiting_for_attempt",
            tool=call["name"],
            tool_use_id=call["id"],
            seconds=round(seconds, 3),
            where="deferred" if deferred else "worker",
        )
        log.warning(
            "%s: an earlier attempt of %s %s may still be running; waiting %.1f s before reconciling it%s",
            self.where,
            call["name"],
            call["id"],
            seconds,
            " (turn deferred)" if deferred else "",
        )
        if deferred:
            raise EarlierAttemptMayRun(until)
        time.sleep(max(0.0, until - time.time()))

    def timeout_of(self, tool: Tool | None, agent: Agent) -> float:
        """The tool's own timeout, else the agent's; no longer than ``max_tool_timeout`` when this
        worker has one (the testing kit's, so that a takeover's wait for an earlier attempt is short)."""
        timeout = (tool.timeout if tool and tool.timeout else None) or agent.tool_timeout
        cap = self.settings.max_tool_timeout
        return min(timeout, cap) if cap else timeout

    def needs_decision(
        self, agent: Agent, call: dict[str, Any], entry: Entry, decisions: dict[str, approvals.Decision]
    ) -> bool:
        tool = agent.tool_named(call["name"])
        # Only a call that would now start needs one: not a recorded outcome, not an unsafe call in
        # doubt (that one is never started again), not a call already refused for another reason.
        if not (
            tool
            and tool.requires_approval
            and entry.outcome is None
            and entry.intent is None
            and "not_run" not in call
            and call["id"] not in decisions
        ):
            return False
        try:
            tool.validate(call["input"])
        except ToolInputError:
            return False  # refused for its input (settle_one says why): nobody is asked about what cannot run
        return True

    def wait_for_approval(self, agent: Agent, calls: list[dict[str, Any]]) -> None:
        """Before any intent is written: record what a person must decide, and release the run.
        Nothing is queued or leased while it waits; the reaper denies a call once its deadline passes."""
        with tracing.span("agentpool.approval_request", **{"agentpool.tools": ",".join(c["name"] for c in calls)}):
            self._request_approval(agent, calls)

    def _request_approval(self, agent: Agent, calls: list[dict[str, Any]]) -> None:
        now = time.time()
        deadlines = []
        for call in calls:
            tool = agent.tool_named(call["name"])
            timeout = tool.approval_timeout if tool and tool.approval_timeout is not None else agent.approval_timeout
            deadline = now + timeout if timeout is not None else None
            deadlines += [deadline] if deadline is not None else []
            approvals.request(self.r, self.keys, self.token, call, now=now, deadline=deadline, at=self.at)
        checkpoint.finish(
            self.r,
            self.keys,
            self.token,
            status="waiting_approval",
            error="",
            watch_at_ms=int(min(deadlines) * 1000) if deadlines else None,
            event=Event.of(
                self.run_id, "status", status="waiting_approval", tools=",".join(call["name"] for call in calls)
            ),
            pool_webhook=self.settings.pool_webhook,
        )

    def settle_one(
        self, agent: Agent, call: dict[str, Any], entry: Entry, decision: approvals.Decision | None = None
    ) -> Outcome:
        if entry.outcome is not None:
            emit(self.r, self.run_id, "reconciled", tool=call["name"], tool_use_id=call["id"], outcome="replayed")
            self.outcomes[call["id"]] = entry.outcome
            return entry.outcome
        if "not_run" in call:
            return self.record(call, Outcome(call["not_run"], True), how="not_run")
        tool = agent.tool_named(call["name"])
        if tool is None and entry.intent is None:
            names = ", ".join(t.name for t in agent.offered_tools) or "none"
            return self.record(
                call, Outcome(f"There is no tool named {call['name']!r}. Tools: {names}.", True), how="unknown_tool"
            )
        action = plan(tool.effect if tool else None, entry, has_verify=bool(tool and tool.verify_fn))
        if entry.intent is not None:
            emit(
                self.r,
                self.run_id,
                "reconciling",
                tool=call["name"],
                tool_use_id=call["id"],
                effect=tool.effect if tool else "?",
                action=action.value,
            )
        if action is Action.UNKNOWN:
            return self.record(call, unknown_outcome(call["name"]), how="unknown")
        assert tool is not None
        kwargs = self.started.get(call["id"]) if entry.intent is None else None
        if kwargs is not None:  # its intent came with save point A: it runs now
            return self.execute(agent, tool, call, kwargs, idempotency_key(self.run_id, call["id"]), attempt=1)
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
            verdict = self.verify(agent, tool, call, kwargs, key, attempt=entry.attempts)
            if verdict is None:
                return self.record(call, unknown_outcome(call["name"]), how="unknown")
            if verdict is not False:
                return self.record(call, result_text(verdict), how="verified")
        return self.execute(agent, tool, call, kwargs, key, attempt=entry.attempts + 1)

    def execute(
        self, agent: Agent, tool: Tool, call: dict[str, Any], kwargs: dict[str, Any], key: str, attempt: int
    ) -> Outcome:
        timeout = self.timeout_of(tool, agent)
        if call["id"] not in self.started:  # a read started by save point A has its intent already
            self.write_intent(tool, call, attempt, timeout)
        stats.hand_over()  # its tool_started counted before the tool can kill the horse
        fault("before_tool", self.run_id, self.turn, tool=call["name"])
        ownership = Ownership(self.r, self.keys, self.token)
        outcome = run_tool(
            tool,
            kwargs,
            call=ToolCall(self.run_id, self.turn, call["id"], key, attempt, owner_check=ownership),
            ownership=ownership,
            timeout=timeout,
            where=self.where,
        )
        fault("in_tool", self.run_id, self.turn, tool=call["name"])
        outcome = self.record(
            call,
            outcome,
            how="ran",
            event=self.tool_event(tool, call, "tool_finished", is_error=outcome.is_error),
            with_save_b=tool.effect == "read",
        )
        fault("after_tool_outcome", self.run_id, self.turn, tool=call["name"])
        return outcome

    def tool_event(self, tool: Tool, call: dict[str, Any], kind: str, **fields: Any) -> Event:
        return Event.of(self.run_id, kind, tool=tool.name, tool_use_id=call["id"], effect=tool.effect, **fields)

    def write_intent(self, tool: Tool, call: dict[str, Any], attempt: int, timeout: float) -> None:
        """The call's intent in the ledger before it runs; for a call with an effect, on the replicas too
        (the durability guard), or it does not run: ``NotReplicated`` hands the turn back."""
        intent = ledger.write_intent(
            self.r,
            self.keys,
            self.token,
            call,
            effect=tool.effect,
            attempt=attempt,
            now=now_ms() / 1000,
            timeout=timeout,
            event=self.tool_event(tool, call, "tool_started", attempt=attempt),
            at=self.at,
        )
        if tool.effect == "read":
            return
        assert self.at is not None
        # The intent and save point A on the replicas first (and on the server that says so), or the
        # call does not run yet.
        proof = Proof(self.keys, self.token, *self.at, field=call["id"], intent=pack(intent))
        try:
            wait_durable(self.r, durability.guard(self.r), proof)
        except NotReplicated:
            self.write_held_outcomes()  # the turn is handed back: what already ran is kept
            withdrawn = self.tool_event(tool, call, "tool_withdrawn", attempt=attempt, reason="not_replicated")
            ledger.withdraw_intent(self.r, self.keys, self.token, call["id"], intent, withdrawn, self.at)
            raise

    def check_decision(self, call: dict[str, Any], decision: approvals.Decision | None) -> Outcome | None:
        """None if a person approved exactly this call; otherwise the is_error outcome to record."""
        if decision is None or not ledger.same_input(decision.input_digest, call["input"]):
            raise LedgerMismatch(f"the approval on record for {call['id']} is missing or was given for other input")
        if decision.approved:
            return None
        who = "The approval request expired" if decision.by == "expiry" else "A person denied this call"
        return Outcome(f"{who}: {decision.reason or 'no reason given'}. It was not executed.", True)

    def verify(
        self, agent: Agent, tool: Tool, call: dict[str, Any], kwargs: dict[str, Any], key: str, attempt: int
    ) -> str | bool | None:
        """The hook's answer, within the tool's own timeout; None (cannot tell) if it hangs or raises."""
        ownership = Ownership(self.r, self.keys, self.token)
        return run_verify(
            tool,
            kwargs,
            call=ToolCall(self.run_id, self.turn, call["id"], key, attempt, owner_check=ownership),
            ownership=ownership,
            timeout=self.timeout_of(tool, agent),
            where=self.where,
        )

    def record(
        self,
        call: dict[str, Any],
        outcome: Outcome,
        *,
        how: str,
        event: Event | None = None,
        with_save_b: bool = False,
    ) -> Outcome:
        """The outcome in the ledger, with ``event`` (by default: how the call was settled without running),
        or, ``with_save_b``, held for save point B (a read tool's: see ``with_save_b`` in ``__init__``).
        Returns it as recorded: made safe to encode and cut to the agent's ``max_result_chars``."""
        outcome = replace(bounded(outcome, self.limit), tool=call["name"])
        event = event or Event.of(
            self.run_id,
            "reconciled" if how in ("unknown", "verified") else "tool_skipped",
            tool=call["name"],
            tool_use_id=call["id"],
            outcome=how,
        )
        self.outcomes[call["id"]] = replace(outcome, how=how)
        if with_save_b:
            self._unwritten[call["id"]] = (call, outcome, event)
            self.with_save_b.append(event)
            return outcome
        self._write(call, outcome, how, event)
        return outcome

    def _write(self, call: dict[str, Any], outcome: Outcome, how: str, event: Event) -> None:
        ledger.write_outcome(
            self.r, self.keys, self.token, call["id"], outcome, how=how, now=now_ms() / 1000, event=event, at=self.at
        )

    def write_held_outcomes(self) -> None:
        """The turn ends without a save point B (it waits, or is handed back): the outcomes held for it
        are written now, each with its event, so what ran is on record."""
        for call, outcome, event in self._unwritten.values():
            self._write(call, outcome, self.outcomes[call["id"]].how, event)
        self._unwritten.clear()
        self.with_save_b.clear()
