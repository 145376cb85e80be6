"""Past the context window: the turn's model call on the run's window, compacting it first when needed.

A turn sends its run's window (``agentpool.store.window``: from the latest compaction point on).

- With the API's compaction (``Agent.compaction_mode == "server"``) every request carries the
  ``compact_20260112`` edit; the API compacts a request past the trigger and the reply starts with a
  ``compaction`` block, which save point A stores like any block and the next request starts from.
- With agentpool's own (``"summary"``), once the next request would pass the trigger (the last call's
  context, plus what was added since) the model is asked for a summary first, in a call of its own:
  streamed, counted in usage and budgets, retried like any call when it fails. Its save
  (``window.commit_summary``) makes the summary the new compaction point, with its spend, in one step;
  a crash before the save redoes it, after the save it is never redone (the window then starts at the
  summary, which passes no trigger).
- A call that stopped with ``model_context_window_exceeded`` (its reply committed like ``max_tokens``)
  or was refused as too long (400 "prompt is too long") makes the next request compact first, by a
  summary, whichever the mode; with compaction off the turn stops the run (``ContextTooLong``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agentpool.agent import SUMMARY_PREAMBLE, Agent
from agentpool.pricing import price_of
from agentpool.runtime import tracing
from agentpool.runtime.estimate import after_last_reply, estimate_tokens
from agentpool.runtime.faults import fault
from agentpool.runtime.model import ContextTooLong, ModelReply, ModelUnavailable
from agentpool.runtime.ratelimit import limited_call
from agentpool.store import window
from agentpool.store.errors import LeaseLost
from agentpool.store.events import Event
from agentpool.store.records import RunState

if TYPE_CHECKING:
    from agentpool.runtime.turn import Turn

OVERFLOW = "model_context_window_exceeded"
log = logging.getLogger("agentpool.turn")
# After a summary the model ended at summary_max_tokens: what it read next knows its tail is missing.
SUMMARY_CUT_NOTE = (
    "\n\n[This summary was cut at its length limit ({limit} tokens): what it would have said after this "
    "point is missing. Check the state of the task before relying on it.]"
)


def due(agent: Agent, state: RunState) -> str | None:
    """Why the window must be compacted before the next call (``overflow``, ``trigger``), or None."""
    compaction = agent.compaction
    reply = state.last_reply
    if agent.compaction_mode is None or not reply:
        return None  # off, or nothing was said since the window's compaction point
    if reply.get("stop_reason") == OVERFLOW:
        return "overflow"
    if agent.compaction_mode == "server":
        return None  # the API compacts the request itself
    estimate = int(reply.get("context_tokens") or 0) + estimate_tokens(after_last_reply(state.messages))
    return "trigger" if estimate >= compaction.trigger else None  # type: ignore[union-attr]


def call(turn: Turn, agent: Agent, state: RunState) -> tuple[RunState, ModelReply]:
    """The turn's call on its window, compacted first when ``due``; a request the API finds too long is
    compacted and sent again, once. Returns the state (its window possibly new) and the reply."""
    compacted = False
    why = due(agent, state)
    if why:
        with tracing.span(
            "agentpool.compaction",
            **{"agentpool.compaction.reason": why, "agentpool.compaction.mode": agent.compaction_mode},
        ):
            state = compact(turn, agent, state, why)
        compacted = True
    try:
        return state, _reply(turn, agent, state)
    except ContextTooLong:
        if agent.compaction_mode is None or compacted or not state.last_reply:
            raise
    state = compact(turn, agent, state, "too_long")
    return state, _reply(turn, agent, state)


def _reply(turn: Turn, agent: Agent, state: RunState) -> ModelReply:
    live = turn.live_output("reply")
    return limited_call(
        turn, agent, state.messages, last_reply=state.last_reply, live=live, on_start=turn.note_call(agent)
    )


def compact(turn: Turn, agent: Agent, state: RunState, why: str) -> RunState:
    """Ask the model for a summary of the window and save it as the run's new compaction point."""
    fault("before_compaction", turn.run_id, turn.turn)
    reply = _summarize(turn, agent, state, shrink=why in ("overflow", "too_long"))
    fault("after_summary_reply", turn.run_id, turn.turn)
    text = "".join(b.get("text", "") for b in reply.message["content"] if b.get("type") == "text").strip()
    if not text:
        raise ModelUnavailable("the model wrote an empty summary", kind="empty_summary", spent=reply.usage)
    cut = reply.stop_reason == "max_tokens"
    if cut:  # saved all the same (it was paid for, and asking again would end the same way), but said
        limit = agent.compaction.summary_max_tokens  # type: ignore[union-attr]
        log.warning(
            "%s: the summary ended at summary_max_tokens=%d; saved with a note that it is cut", turn.where, limit
        )
        text += SUMMARY_CUT_NOTE.format(limit=limit)
    index = state.window_start + len(state.messages)
    message = {"role": "user", "content": [{"type": "text", "text": SUMMARY_PREAMBLE + text}]}
    price = price_of(agent.model)
    cost = price.cost(reply.usage) if price else 0.0
    try:
        window.commit_summary(
            turn.r,
            turn.keys,
            turn.token,
            turns_before=state.turns,
            index=index,
            message=message,
            meta={**reply.meta, "compaction": "summary", "covers": [state.window_start, index - 1]},
            usage=reply.usage,
            cost_usd=cost,
            ancestors=state.ancestors,
            rest=turn.rest_of_call(agent.model, str(reply.meta.get("id") or ""), reply.usage),
            event=Event.of(
                turn.run_id,
                "compacted",
                turn=turn.turn,
                mode="summary",
                why=why,
                messages=len(state.messages),
                window_start=index,
                seconds=round(reply.seconds, 4),
                cost_usd=round(cost, 8),
                **({"cut": "max_tokens"} if cut else {}),
                **reply.usage,
            ),
        )
    except LeaseLost:
        fault("after_spend_refused", turn.run_id, turn.turn)
        raise
    fault("after_compaction_save", turn.run_id, turn.turn)
    state.messages, state.window_start, state.window_hint, state.last_reply = [message], index, index, {}
    return state


def _summarize(turn: Turn, agent: Agent, state: RunState, *, shrink: bool) -> ModelReply:
    """The summary call. A window that is full (or found too long, or whose summary the window cut
    short) is summarized from a copy with its long tool results and texts cut (``shrink``)."""
    try:
        live = turn.live_output("summary")
        reply = limited_call(
            turn, agent, state.messages, summary=True, shrink=shrink, live=live, on_start=turn.note_call(agent)
        )
    except ContextTooLong:
        if shrink:
            raise
        return _summarize(turn, agent, state, shrink=True)
    if reply.stop_reason == OVERFLOW and not shrink:
        turn.count_unused_call(agent.model, reply.usage, "summary cut short by the context window")
        return _summarize(turn, agent, state, shrink=True)
    return reply


def window_hint(state: RunState, reply: ModelReply | None = None) -> int | None:
    """The index save point A (and B, for the next turn's job) records as the run's window, when it
    moved: a compaction block in this turn's reply, or one the header lags behind (a crash between the
    save points, a run committed by a release that moved it at save point B only)."""
    if reply is not None and reply.compacted:
        return state.window_start + len(state.messages)
    return state.window_start if state.window_start > state.window_hint else None
