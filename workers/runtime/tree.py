"""One budget for a tree of runs, and ``resume`` of a tree.

Every model call's spend is added, in the script that counts it, to the tree counters of every run
above it (``store/lua/_tree.lua``), so a run's ``usage`` is its tree's, live. A run that starts child
runs records its own limits as its tree's caps. Before each model call a child run checks its
ancestors' caps (``hold_if_spent``): when one is used up, the run stops *held*: its parent's join stays
open (the parent gets no error result: the tree stops as one, as a single run stops at its limit), and
the ancestor whose cap it is (the holder) stops too if it waits for its children (``store/lua/hold.lua``),
or instead of waiting (``store/lua/wait_children.lua``). The tree can pass its cap by at most the calls
in flight when the cap is reached: one per run of the tree running then.

``resume(holder)`` then goes on with the whole tree in one transaction (``plan`` and ``stage``): the
amounts it adds raise the caps of the runs it resumes (what it adds to the parent is what the tree may
spend), every stopped run below it is resumed (held ones go on, and their answers become their parents'
tool_results as if nothing had stopped), and a run stopped while it waited for its children waits for
them again.

A child stopped by its own limit (its agent's ``max_turns``, say, or repeated model errors) is not held:
it ends its parent's join with an ``is_error`` tool_result, and the parent goes on. Resumed later (with
its tree, or by itself), its answer reaches the parent as a message (``subagents.late_answer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.client import Pipeline

from agentpool.runtime.limits import Limits
from agentpool.runtime.takeover import read_header, stage_restart
from agentpool.store import checkpoint, children, inbox
from agentpool.store.children import Budget
from agentpool.store.clock import now_ms
from agentpool.store.codec import pack
from agentpool.store.errors import AgentPoolError
from agentpool.store.events import Event
from agentpool.store.keys import RUNS_WATCH, RunKeys
from agentpool.store.records import TERMINAL_STATUSES, RunState

if TYPE_CHECKING:
    from agentpool.runtime.turn import Turn

EXTRA_OF = {"add_turns": "extra_turns", "add_tokens": "extra_tokens", "add_usd": "extra_usd"}
CAP_OF = {"add_turns": "cap_turns", "add_tokens": "cap_tokens", "add_usd": "cap_usd"}


# -- the guard -----------------------------------------------------------------------------------


# An ancestor that ended (it answered, failed, or was cancelled) holds no run: a descendant that goes on
# after it (a child stopped by its own limit, its join ended with an error result, then resumed by a
# person) would be held by a budget that no resume could raise, as ``resume`` of an ended run does not
# go down its tree. Its spend still reaches the ended ancestor's tree counters.
_ENDED = frozenset({"completed", "failed", "cancelled"})


def spent_ancestor(r: Redis, ancestors: list[str]) -> Budget | None:
    """The nearest ancestor, still in its tree's life, whose budget for its tree is used up, or None."""
    return next((b for b in children.budgets(r, ancestors) if b.exhausted and b.status not in _ENDED), None)


def used_up(budget: Budget) -> str:
    """``max_total_tokens=20000 (20345 tokens spent)``: which cap, and what the tree spent."""
    if budget.exhausted == "max_total_tokens":
        return f"max_total_tokens={budget.cap_tokens} ({budget.tokens} tokens spent)"
    return f"max_cost_usd={budget.cap_usd:g} (${budget.cost_usd:.4f} spent)"


def holder_limits(budget: Budget) -> dict[str, Any]:
    """The limits the holder is held to, for its ``status`` event (what ``resume`` checks against)."""
    if budget.cap_turns is None:
        return {}
    return Limits(budget.cap_turns, budget.cap_tokens, budget.cap_usd).limit_fields()


def hold_if_spent(turn: Turn, state: RunState, limits: Limits) -> str | None:
    """Before a child run's model call: stop it, held, if an ancestor's budget for its tree is used up
    (``"stopped"``); None to go on."""
    budget = spent_ancestor(turn.r, state.ancestors)
    if budget is None:
        return None
    more = "tokens" if budget.exhausted == "max_total_tokens" else "budget"
    reason = (
        f"held: run {budget.run_id} and its sub-agents reached its {used_up(budget)}; resume run "
        f"{budget.run_id} with more {more} and this run goes on with it"
    )
    holder_reason = (
        f"reached {used_up(budget)} with its sub-agents; resume with more {more} to continue: its stopped "
        "sub-agents go on with it"
    )
    code = children.hold(
        turn.r,
        turn.keys,
        turn.token,
        holder=budget,
        reason=reason,
        holder_reason=holder_reason,
        event=Event.of(
            turn.run_id, "status", status="stopped", error=reason, held_by=budget.run_id, **limits.limit_fields()
        ),
        holder_event=Event.of(budget.run_id, "status", status="stopped", error=holder_reason, **holder_limits(budget)),
        pool_webhook=turn.settings.pool_webhook,
    )
    if code == 0:
        return None  # resumed meanwhile: its cap is raised
    if code == 3:
        from agentpool.runtime.subagents import wake_parent_of

        wake_parent_of(turn.r, budget.run_id)  # the holder stopped and was its parent's last open child
    return "stopped"


def wait_stop(run_id: str, limits: Limits) -> tuple[str, Event]:
    """The reason and event of a run that stops instead of waiting for its children because its budget
    for its tree is used up (``children.wait``)."""
    caps = [
        f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in (("max_total_tokens", limits.max_total_tokens), ("max_cost_usd", limits.max_cost_usd))
        if value is not None
    ]
    reason = (
        f"reached its budget ({', '.join(caps)}) with its sub-agents; resume with more to continue: its stopped "
        "sub-agents go on with it"
    )
    return reason, Event.of(run_id, "status", status="stopped", error=reason, **limits.limit_fields())


# -- resume of a tree ----------------------------------------------------------------------------


@dataclass
class Resumed:
    """A run ``resume`` goes on with: its state, header counters, and whether it waits for children."""

    state: RunState
    requeues: int
    caps: dict[str, str]
    waits: bool = False  # stopped while waiting for its children, some still open: it waits again
    # Messages that arrived just before it stopped (still in its inbox), and where they go in the
    # conversation: delivered with the resume, so the model call it goes on with sees them.
    waiting: list[tuple[str, Any]] = field(default_factory=list)
    length: int = 0


@dataclass
class Plan:
    """The runs below the resumed one that go on with it, and the stopped ones left as they are (each
    with why: it would stop again at once on a limit of its own)."""

    runs: list[Resumed] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)


def held_by(r: Redis | Pipeline, state: RunState) -> str:
    """The ancestor whose used-up budget holds this stopped run ("" when it is not held: stopped on its
    own, or its parent's join has ended since)."""
    if state.status != "stopped" or not state.held or not state.parent:
        return ""
    return state.held if r.hget(RunKeys.of(state.parent).joins, state.id) == b"open" else ""


def open_joins(r: Redis | Pipeline, run_id: str) -> bool:
    return "open" in children.joins(r, RunKeys.of(run_id)).values()


def resumed(pipe: Pipeline, state: RunState) -> Resumed:
    """What staging the resume of ``state``'s run needs, read under WATCH of its header (and joins)."""
    keys = RunKeys.of(state.id)
    header = read_header(pipe, state.id)
    assert header is not None
    caps = {
        name: raw.decode()
        for name, raw in zip(CAP_OF.values(), pipe.hmget(keys.run, list(CAP_OF.values())), strict=True)
        if raw
    }
    waits = state.phase == "tools" and open_joins(pipe, state.id)
    waiting: list[tuple[str, Any]] = []
    length = 0
    if state.phase != "tools":  # its next step is a model call (with pending tools, their save point B delivers them)
        pipe.watch(keys.inbox)
        waiting, length = inbox.read_for_delivery(pipe, keys)
    return Resumed(state, header.requeues, caps, waits, waiting, length)


def plan(pipe: Pipeline, top: RunState, short_of: Callable[[RunState], str | None]) -> Plan:
    """Under WATCH (each run read is watched as it is read): the stopped runs below ``top`` that go on
    with it, found through every run that has not ended for good (a subtree under a completed, failed
    or cancelled run is left: nobody waits for it). ``short_of(state)`` says what a run would lack to
    take a turn with what the resume adds: a held run lacking it makes the whole resume refused
    (``ValueError`` with the reason: the tree cannot go on without it), another is left stopped."""
    out = Plan()
    todo = [top.id]
    while todo:
        run_id = todo.pop(0)
        for child in children.children(pipe, RunKeys.of(run_id)):
            keys = RunKeys.of(child)
            pipe.watch(keys.run, keys.joins)
            try:
                state = checkpoint.load_run(pipe, child, with_messages=False)  # type: ignore[arg-type]
            except AgentPoolError:  # expired, unreadable or newer than this code: nothing to resume there
                continue
            if state.status in TERMINAL_STATUSES:
                continue
            todo.append(child)
            if state.status != "stopped":
                continue
            short = short_of(state)
            if short and held_by(pipe, state):
                raise ValueError(f"its sub-agent run {child} would stop again at once: {short}")
            if short:
                out.left[child] = short
                continue
            out.runs.append(resumed(pipe, state))
    return out


def stage(pipe: Pipeline, r: Redis, run: Resumed, adds: Mapping[str, int | float], event: Event) -> None:
    """In MULTI: the run goes on, its limits and caps raised by ``adds``: its turn queued again, or,
    stopped while it waited for children still open, waiting for them again (nothing queued)."""
    state, keys = run.state, RunKeys.of(run.state.id)
    limits = dict(state.limits)
    for name, extra in EXTRA_OF.items():
        if adds.get(name):
            before = limits.get(extra, 0)
            # A NaN an older version let in is replaced, not added to (NaN + x is NaN).
            limits[extra] = (before if math.isfinite(before) else 0) + adds[name]
    caps = {
        cap: repr(float(run.caps[cap]) + float(adds[name]))
        if cap == "cap_usd"
        else int(run.caps[cap]) + int(adds[name])
        for name, cap in CAP_OF.items()
        if adds.get(name) and cap in run.caps
    }
    fields = {"error": "", "model_errors": 0, "limits": pack(limits), **caps}
    pipe.hdel(keys.run, "held")
    pipe.delete(keys.handback)
    if run.waits:
        pipe.hset(keys.run, mapping={**fields, "status": "waiting_children", "updated_at": now_ms()})
        pipe.zadd(RUNS_WATCH, {state.id: now_ms() + children.WAITING_RECHECK_MS})
    else:
        inbox.stage_user_message(pipe, keys, None, run.waiting, turns=state.turns, index=run.length)
        stage_restart(
            pipe,
            r,
            state.id,
            turn=state.current_turn,
            attempt=0,
            requeues=run.requeues,
            fields={**fields, "status": "running"},
        )
    event.stage(pipe)
