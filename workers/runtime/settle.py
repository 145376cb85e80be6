"""Settling a turn's tool_uses: one tool_result for each, reconciled against the ledger.

A call whose outcome is on record replays it; a call nobody started runs (after a person's decision,
if its tool needs one); a call started by a dead worker is decided by ``reconcile.plan``. Every step
writes the ledger first (an intent before the tool, an outcome after), fenced by the turn's lease.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from redis import Redis

from agentpool.agent import Agent
from agentpool.context import ToolCall
from agentpool.runtime.faults import fault
from agentpool.runtime.reconcile import Action, idempotency_key, plan, unknown_outcome
from agentpool.runtime.toolcall import run_tool
from agentpool.store import approvals, checkpoint, ledger
from agentpool.store.clock import now_ms
from agentpool.store.errors import LedgerMismatch
from agentpool.store.events import Event, emit
from agentpool.store.keys import RunKeys
from agentpool.store.ledger import Entry, Outcome
from agentpool.tools import Tool, ToolInputError

log = logging.getLogger("agentpool.turn")


class Settlement:
    """The tool calls of one turn, settled under the turn's lease ``token``."""

    def __init__(self, r: Redis, keys: RunKeys, token: str, turn: int) -> None:
        self.r, self.keys, self.token, self.turn = r, keys, token, turn
        self.run_id = keys.run_id
        self.where = f"run {self.run_id} turn {turn}"
        self.outcomes: dict[str, Outcome] = {}  # settled this turn, compacted in the ledger at save point B

    def settle(
        self, agent: Agent, pending: list[dict[str, Any]], *, fresh: bool = False
    ) -> list[dict[str, Any]] | None:
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
        return [
            self.settle_one(agent, call, entries[call["id"]], decisions.get(call["id"])).as_tool_result(call["id"])
            for call in pending
        ]

    def needs_decision(
        self, agent: Agent, call: dict[str, Any], entry: Entry, decisions: dict[str, approvals.Decision]
    ) -> bool:
        tool = agent.tool_named(call["name"])
        # Only a call that would now start needs one: not a recorded outcome, not an unsafe call in
        # doubt (that one is never started again), not a call already refused for another reason.
        return bool(
            tool
            and tool.requires_approval
            and entry.outcome is None
            and entry.intent is None
            and "not_run" not in call
            and call["id"] not in decisions
        )

    def wait_for_approval(self, agent: Agent, calls: list[dict[str, Any]]) -> None:
        """Before any intent is written: record what a person must decide, and release the run.
        Nothing is queued or leased while it waits; the reaper denies a call once its deadline passes."""
        now = time.time()
        deadlines = []
        for call in calls:
            tool = agent.tool_named(call["name"])
            timeout = tool.approval_timeout if tool and tool.approval_timeout is not None else agent.approval_timeout
            deadline = now + timeout if timeout is not None else None
            deadlines += [deadline] if deadline is not None else []
            approvals.request(self.r, self.keys, self.token, call, now=now, deadline=deadline)
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
            names = ", ".join(t.name for t in agent.tools) or "none"
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

    def execute(
        self, agent: Agent, tool: Tool, call: dict[str, Any], kwargs: dict[str, Any], key: str, attempt: int
    ) -> Outcome:
        ledger.write_intent(
            self.r,
            self.keys,
            self.token,
            call,
            effect=tool.effect,
            attempt=attempt,
            now=now_ms() / 1000,
            event=Event.of(
                self.run_id, "tool_started", tool=tool.name, tool_use_id=call["id"], effect=tool.effect, attempt=attempt
            ),
        )
        outcome = run_tool(
            tool,
            kwargs,
            call=ToolCall(self.run_id, self.turn, call["id"], key, attempt),
            timeout=tool.timeout or agent.tool_timeout,
            limit=agent.max_result_chars,
            where=self.where,
        )
        fault("in_tool", self.run_id, self.turn)
        self.record(
            call,
            outcome,
            how="ran",
            event=Event.of(
                self.run_id,
                "tool_finished",
                tool=tool.name,
                tool_use_id=call["id"],
                effect=tool.effect,
                is_error=outcome.is_error,
            ),
        )
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
        except Exception as exc:  # noqa: BLE001 - a hook that fails cannot tell: the outcome is unknown
            log.warning("%s: verify hook of %s raised %s; treating the outcome as unknown", self.where, tool.name, exc)
            return None

    def record(self, call: dict[str, Any], outcome: Outcome, *, how: str, event: Event | None = None) -> Outcome:
        """The outcome in the ledger, with ``event`` (by default: how the call was settled without running)."""
        event = event or Event.of(
            self.run_id,
            "reconciled" if how in ("unknown", "verified") else "tool_skipped",
            tool=call["name"],
            tool_use_id=call["id"],
            outcome=how,
        )
        ledger.write_outcome(
            self.r, self.keys, self.token, call["id"], outcome, how=how, now=now_ms() / 1000, event=event
        )
        self.outcomes[call["id"]] = replace(outcome, how=how)
        return outcome
