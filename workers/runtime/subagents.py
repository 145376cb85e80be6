"""Sub-agent calls in a turn: each starts a child run (once per tool_use), the turn waits for them
without holding anything, and their ends become the tool_results (see ``agentpool.store.children``).

A call is refused with an ``is_error`` result, never a failed run, when the tree is as deep as the
agent allows (``max_depth``), when one response asks for more than ``max_fanout`` of them, or when
its input is not ``{"task": "..."}``. A child gets what its parent has left of its token and USD
budget when it starts (the parent's own usage and its ended children's): it cannot outspend it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.agent import Agent
from agentpool.runtime.jobs import stage_turn
from agentpool.runtime.limits import Limits
from agentpool.runtime.loader import AgentNotFound, load_agent
from agentpool.runtime.takeover import read_header, stage_restart
from agentpool.store import checkpoint, children, watch, writes
from agentpool.store.clock import now_ms
from agentpool.store.errors import RunNotFound, UnreadableRecord
from agentpool.store.events import Event, emit
from agentpool.store.keys import RunKeys
from agentpool.store.ledger import Outcome
from agentpool.store.records import ENDED_FOR_PARENT, RunState

log = logging.getLogger("agentpool.subagents")
CUT_NOTE = "\n\n[The answer was cut to {limit} characters here; the whole of it is the result of run {run}.]"


class Delegation:
    """The sub-agent calls of one turn of ``state``'s run, under the turn's lease ``token``."""

    def __init__(self, r: Redis, keys: RunKeys, token: str, agent: Agent, state: RunState) -> None:
        self.r, self.keys, self.token, self.agent, self.state = r, keys, token, agent, state

    def refusal(self, call: dict[str, Any], index: int) -> Outcome | None:
        """Why the call starts no child (an is_error outcome for the model), or None."""
        task = call["input"].get("task") if isinstance(call.get("input"), dict) else None
        if not isinstance(task, str) or not task.strip():
            return Outcome(
                f'The {call["name"]} sub-agent needs an input {{"task": "..."}} with a non-empty task.', True
            )
        if self.state.depth >= self.agent.max_depth:
            return Outcome(
                f"Not started: sub-agents may nest {self.agent.max_depth} levels deep and this run is at that "
                "depth. Do this part yourself.",
                True,
            )
        if index >= self.agent.max_fanout:
            return Outcome(
                f"Not started: one response may start at most {self.agent.max_fanout} sub-agents; this was "
                f"call {index + 1}. Wait for these results, then delegate the rest.",
                True,
            )
        return None

    def start(self, call: dict[str, Any]) -> str:
        """The child run answering ``call``, created now unless it exists (a turn taken over finds it)."""
        sub = self.agent.subagent_named(call["name"])
        assert sub is not None
        child = children.child_id(self.keys.run_id, call["id"])
        created = children.spawn(
            self.r,
            self.keys,
            self.token,
            child,
            agent=sub.path,
            task=call["input"]["task"],
            limits=self.budget(sub.path),
            fields={"parent": self.keys.run_id, "parent_call": call["id"], "depth": self.state.depth + 1},
            stage_enqueue=lambda pipe: stage_turn(pipe, self.r, child, 0),
            now=time.time(),
        )
        if created:
            emit(self.r, child, "status", status="queued", agent=sub.path, parent=self.keys.run_id)
            emit(self.r, self.keys.run_id, "child_started", tool_use_id=call["id"], child=child, agent=sub.path)
        return child

    def budget(self, path: str) -> dict[str, Any]:
        """The child's limits: what the parent has left (its tree's usage so far against its limits), or
        the sub-agent's own limit where that is lower."""
        limits = Limits.of(self.agent, self.state.limits)
        try:
            own: Agent | None = load_agent(path)
        except AgentNotFound:
            own = None  # its worker will say so; the parent's remainder still caps it
        out: dict[str, Any] = {}
        if limits.max_total_tokens is not None:
            left = max(1, limits.max_total_tokens - sum(self.state.usage.values()))
            out["max_total_tokens"] = min(left, own.max_total_tokens or left) if own else left
        if limits.max_cost_usd is not None:
            left_usd = max(1e-9, limits.max_cost_usd - self.state.cost_usd)
            out["max_cost_usd"] = min(left_usd, own.max_cost_usd or left_usd) if own else left_usd
        return out

    def outcome(self, call: dict[str, Any], child: str) -> Outcome | None:
        """The tool_result of a child that has ended, or None while it runs."""
        try:
            state = checkpoint.load_run(self.r, child, with_messages=False)
        except RunNotFound:
            return Outcome(f"The {call['name']} sub-agent's run {child} no longer exists (expired?).", True)
        if state.status not in ENDED_FOR_PARENT:
            return None
        if state.status == "completed":
            text = state.result or ""
            limit = self.agent.max_result_chars
            if len(text) > limit:
                note = CUT_NOTE.format(limit=limit, run=child)
                text = text[: max(0, limit - len(note))] + note
            return Outcome(text, False)
        return Outcome(
            f"The {call['name']} sub-agent (run {child}) {state.status} without an answer: "
            f"{state.error or 'no reason given'}.",
            True,
        )


def wake(r: Redis, run_id: str) -> str | None:
    """Queue the turn of a parent whose last child ended (its ``wake`` marker set by that child's end),
    once: the marker goes in the same transaction. Returns the job id, or None if there was nothing to
    do (no marker: woken already, or never waiting)."""
    keys = RunKeys.of(run_id)

    def attempt(pipe: Pipeline, write_id: str) -> str | None:
        try:
            header = read_header(pipe, run_id)
        except UnreadableRecord:
            pipe.unwatch()
            return None  # the reaper fails it with the reason
        if header is None or writes.landed(header.writes, write_id):
            pipe.unwatch()
            return header.job if header else None
        if pipe.hget(keys.run, "wake") != b"1" or header.status != "running" or pipe.exists(keys.lease):
            pipe.unwatch()
            return None
        pipe.multi()
        pipe.hdel(keys.run, "wake")
        jid = stage_restart(pipe, r, run_id, turn=header.turn, attempt=header.attempt, requeues=header.requeues)
        writes.stage_remember(pipe, keys.run, write_id)
        pipe.execute()
        return jid

    jid = writes.watched(r, [keys.run, keys.lease], attempt)
    if jid:
        log.info("run %s: its children have ended; turn queued as %s", run_id, jid)
        emit(r, run_id, "status", status="running", reason="children ended", job=jid)
    return jid


def wake_parent_of(r: Redis, run_id: str) -> None:
    """After this child's end woke its parent (the join is already durable): queue the parent's turn now
    rather than at the reaper's next scan. Best effort; the reaper does it if this worker dies first."""
    try:
        parent = r.hget(RunKeys.of(run_id).run, "parent")
        if parent:
            wake(r, parent.decode())
    except Exception:  # the marker stays: the reaper acts on it
        log.exception("run %s: could not queue its parent's turn; the reaper will", run_id)


def check_waiting(r: Redis, run_id: str) -> None:
    """The reaper's backstop for a run waiting on children: a child that ended without telling it (its
    record expired, say) is joined now; then the run is looked at again later, if it still waits."""
    for child, joined in children.joins(r, RunKeys.of(run_id)).items():
        status = r.hget(RunKeys.of(child).run, "status") if joined == "open" else None
        if joined == "open" and (status is None or status.decode() in ENDED_FOR_PARENT):
            children.child_ended(r, child, run_id)
    watch.reschedule_children(r, run_id, now_ms() + children.WAITING_RECHECK_MS)


def waiting_event(run_id: str, calls: list[dict[str, Any]]) -> Event:
    return Event.of(run_id, "status", status="waiting_children", children=len(calls))
