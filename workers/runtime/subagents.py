"""Sub-agent calls in a turn: each starts a child run (once per tool_use), the turn waits for them
without holding anything, and their ends become the tool_results (see ``agentpool.store.children``).

A call is refused with an ``is_error`` result, never a failed run, when the tree is as deep as the
agent allows (``max_depth``), when one response asks for more than ``max_fanout`` of them, or when
its input is not ``{"task": "..."}``. A child is held to its own agent's limits and, live, to every
ancestor's budget for the tree (``agentpool.runtime.tree``). It runs on its parent's queue and under
its parent's concurrency key unless the sub-agent names its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.agent import Agent
from agentpool.runtime import tracing
from agentpool.runtime.jobs import stage_turn
from agentpool.runtime.limits import Limits
from agentpool.runtime.takeover import read_header, stage_restart
from agentpool.store import checkpoint, children, inbox, watch, writes
from agentpool.store.clock import now_ms
from agentpool.store.errors import RunNotFound, UnreadableRecord
from agentpool.store.events import Event, emit
from agentpool.store.keys import RunKeys
from agentpool.store.ledger import Outcome
from agentpool.store.records import ENDED_FOR_PARENT, TERMINAL_STATUSES, RunState

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
        queue = sub.queue or self.state.queue
        fields: dict[str, Any] = {
            "parent": self.keys.run_id,
            "parent_call": call["id"],
            "parent_tool": call["name"],
            "parent_chars": self.agent.max_result_chars,
            "depth": self.state.depth + 1,
            "ancestors": " ".join([self.keys.run_id, *self.state.ancestors]),
            "queue": queue,
        }
        traced_from = tracing.current_parent()  # the parent's turn: the child's run is a span of its trace
        if traced_from:
            fields[tracing.PARENT_FIELD] = traced_from
        if sub.concurrency_key:  # its own key, limited by max_concurrency or an operator's setting
            fields["ckey"] = sub.concurrency_key
            fields.update({"cmax": sub.max_concurrency} if sub.max_concurrency else {})
        elif self.state.concurrency_key:  # its parent's key: the tree's turns count as the tenant's
            fields["ckey"] = self.state.concurrency_key
            fields.update({"cmax": self.state.max_concurrency} if self.state.max_concurrency else {})
        limits = Limits.of(self.agent, self.state.limits)
        created = children.spawn(
            self.r,
            self.keys,
            self.token,
            child,
            agent=sub.path,
            task=call["input"]["task"],
            limits={},  # its own agent's; the tree's budget is checked live (agentpool.runtime.tree)
            fields=fields,
            caps={
                "cap_turns": limits.max_turns,
                "cap_tokens": limits.max_total_tokens,
                "cap_usd": None if limits.max_cost_usd is None else repr(float(limits.max_cost_usd)),
            },
            stage_enqueue=lambda pipe: stage_turn(pipe, self.r, child, 0, queue=queue),
            now=time.time(),
        )
        if created:
            emit(self.r, child, "status", status="queued", agent=sub.path, parent=self.keys.run_id, queue=queue)
            emit(self.r, self.keys.run_id, "child_started", tool_use_id=call["id"], child=child, agent=sub.path)
        return child

    def outcome(self, call: dict[str, Any], child: str) -> Outcome | None:
        """The tool_result of a child that has ended, or None while it runs (or is held: stopped
        because its tree's budget ran out, it goes on when the tree is resumed). Whether it ended is
        its parent's join's to say: a child that stopped, ended its join, and was resumed since is
        answered by its stop (its answer comes later, as a message)."""
        joined, ended = self.r.hmget(self.keys.joins, [child, f"{child}:end"])
        try:
            state = checkpoint.load_run(self.r, child, with_messages=False)
        except RunNotFound:
            return Outcome(f"The {call['name']} sub-agent's run {child} no longer exists (expired?).", True)
        if joined == b"open":
            return None
        # How it ended when it was joined (a join made before this was recorded: its status, which a
        # resume may have changed since).
        ended_as = ended.decode() if ended else state.status
        if ended_as != "completed" and state.status not in ENDED_FOR_PARENT:
            return Outcome(
                f"The {call['name']} sub-agent (run {child}) {ended_as} without an answer and has been resumed "
                "since; its answer will be sent to you as a message when it finishes.",
                True,
            )
        if ended_as == "completed":
            text = state.result or ""
            limit = self.agent.max_result_chars
            if len(text) > limit:
                note = CUT_NOTE.format(limit=limit, run=child)
                text = text[: max(0, limit - len(note))] + note
            return Outcome(text, False)
        return Outcome(
            f"The {call['name']} sub-agent (run {child}) {ended_as} without an answer: "
            f"{state.error or 'no reason given'}.",
            True,
        )


LATE_NOTE = (
    "[The {tool} sub-agent you called earlier (tool_use {call}, child run {run}) had stopped without an "
    "answer and was resumed; it has now finished. Its answer:]\n\n"
)


def late_answer(state: RunState, result: str) -> tuple[str, bytes] | None:
    """For a reply that completes a child run: the message id and packed content of its answer for its
    parent, which save point A queues in the parent's inbox if the parent's join had already ended (the
    child stopped, answered with an error, and was resumed). The id names the completion (the child's
    turn count then), so a retried save point delivers it once and a later completion (the child sent a
    message after this) is a new one. None for a top-level run."""
    if not state.parent:
        return None
    note = LATE_NOTE.format(tool=state.parent_tool or "sub-agent", call=state.parent_call, run=state.id)
    limit = state.parent_chars or 100_000
    text = note + result
    if len(text) > limit:
        cut = CUT_NOTE.format(limit=limit, run=state.id)
        text = text[: max(0, limit - len(cut))] + cut
    return f"{state.id}.t{state.turns + 1}", inbox.pack_content(text)


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
        # A stopped child whose join is open is held (its tree's budget ran out): it is resumed, not joined.
        if joined == "open" and (status is None or status.decode() in TERMINAL_STATUSES):
            children.child_ended(r, child, run_id)
    watch.reschedule_children(r, run_id, now_ms() + children.WAITING_RECHECK_MS)


def waiting_event(run_id: str, calls: list[dict[str, Any]]) -> Event:
    return Event.of(run_id, "status", status="waiting_children", children=len(calls))
