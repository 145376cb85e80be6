"""Conversations: follow-up messages to a run (``send_message``) and forks of a run (``fork_run``).

A message to a run that is queued, running or waiting for a person waits in its inbox and is
delivered at the run's next turn boundary (``agentpool.store.inbox``). A message to a completed run (or
one stopped for a reason other than a limit) becomes its next user message at once and the run goes on;
one that a limit stopped, or that completed at a limit, refuses it until ``resume`` raises its limits.
A fork is a new run holding a copy of another's conversation up to the end of one of its committed
turns (from the latest, with the messages still waiting in its inbox); it runs no tool again (the copy
holds their results) and its usage starts from zero.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from redis import Redis
from redis.client import Pipeline

from agentpool.checks import optional_actor
from agentpool.client import held_by, last_stop, limits_held_to, new_run_id
from agentpool.runtime import shards, tracing
from agentpool.runtime.answers import FINISHED_STOPS, trailing_text
from agentpool.runtime.estimate import call_from_field
from agentpool.runtime.faults import fault
from agentpool.runtime.jobs import stage_turn
from agentpool.runtime.limits import Limits
from agentpool.runtime.settings import Settings, names_the_server
from agentpool.runtime.takeover import read_header, stage_restart
from agentpool.store import checkpoint, children, inbox, writes
from agentpool.store.errors import MessageRefused, RunExists, RunNotFound
from agentpool.store.events import Event
from agentpool.store.keys import RUNS, RUNS_WATCH, RunKeys, check_run_id
from agentpool.store.records import RunState, message_meta, new_header, pack_message, pack_result, unpack_message
from agentpool.store.window import is_compaction_point

# The blocks a user message may hold besides tool_results (which only a turn writes).
USER_BLOCKS = ("text", "image", "document")
# No ":": the received hash keeps a delivered message's marker under "<message_id>:at".
MESSAGE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


def new_message_id() -> str:
    return f"m_{int(time.time() * 1000):012x}{secrets.token_hex(5)}"


def check_content(content: Any) -> str | list[dict[str, Any]]:
    """A message's content as the Messages API takes it in a user message: non-empty text, or a list of
    text, image and document blocks. Anything else is a ValueError saying what is wrong."""
    if isinstance(content, str):
        if not content.strip():
            raise ValueError("a message needs non-empty text")
        return content
    if not isinstance(content, list) or not content:
        raise ValueError("a message is a non-empty str or a non-empty list of content blocks")
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in USER_BLOCKS:
            raise ValueError(
                f"content block {i} has type {kind!r}: a message may hold {', '.join(USER_BLOCKS)} blocks "
                "(tool_result blocks are written by the run itself)"
            )
        if kind == "text" and not (isinstance(block.get("text"), str) and block["text"].strip()):
            raise ValueError(f"content block {i}: a text block needs non-empty 'text'")
        if kind != "text" and not isinstance(block.get("source"), dict):
            raise ValueError(f"content block {i}: an {kind} block needs a 'source' object")
    return [dict(block) for block in content]


@names_the_server
def send_message(
    run_id: str,
    content: str | list[dict[str, Any]],
    *,
    message_id: str | None = None,
    by: str | None = None,
    connection: Redis | str | shards.Shards | None = None,
) -> str:
    """Send a user message to a run; returns the message's id. ``by`` names who sends it: the event that
    records its arrival (``message_queued``, or the ``status`` event of a run it sets going) keeps it.

    - ``queued``, ``running``, ``waiting_approval``: the message waits in the run's inbox and is
      delivered at its next turn boundary, after that turn's tool_results in the same user message,
      never in the middle of a turn; several keep the order they were sent in. A reply that would
      have completed the run answers them first.
    - ``completed``: the message becomes the next user message and the run goes on (its turns,
      usage and limits carry on).
    - ``stopped``: the same, unless a limit stopped it and still would: then ``MessageRefused`` says
      what ``resume`` must add; resume it, then send (the message is then answered before the run
      completes). A run that ``completed`` at a limit (its last turn used up its turns, tokens or
      money) is refused the same way: ``resume`` raises its limits, and it stays completed until sent.
    - ``cancelled``, ``failed``: ``MessageRefused`` saying so.

    Idempotent with ``message_id``: a retried call with the same id and content stores and delivers
    the message once and returns the id; the same id with other content raises ``MessageRefused``."""
    content = check_content(content)
    by = optional_actor(by)
    if message_id is None:
        message_id = new_message_id()
    elif not isinstance(message_id, str) or not MESSAGE_ID.match(message_id):
        raise ValueError("message_id: 1 to 100 letters, digits or _ . -")
    r = shards.route(connection, run_id)
    keys = RunKeys.of(run_id)

    def attempt(pipe: Pipeline, write_id: str) -> str:
        header = read_header(pipe, run_id)
        if header is None:
            raise RunNotFound(run_id)
        if writes.landed(header.writes, write_id):
            pipe.unwatch()
            return message_id
        stored = pipe.hget(keys.received, message_id)
        if stored is not None:
            pipe.unwatch()
            if inbox.unpack_content(stored, f"message {message_id}") != content:
                raise MessageRefused(run_id, f"message id {message_id!r} was already used for another message")
            return message_id  # a retry: it was stored (and is or will be delivered) once
        state = checkpoint.load_run(pipe, run_id, with_messages=False)  # type: ignore[arg-type]
        stop = last_stop(r, run_id) if state.status in ("stopped", "completed") else {}
        refused = _refusal(state, held_by(stop))
        if refused:
            raise MessageRefused(run_id, refused)
        # Straight into the conversation when nothing is in flight: the run's next step is a model call.
        # A stopped run may hold messages that arrived just before it stopped (a limit checked at a
        # turn's start ends it with its inbox as it was): they go in with this one, ahead of it.
        at_once = state.status == "completed" or (state.status == "stopped" and state.phase != "tools")
        waiting = inbox.read_waiting(pipe, keys) if at_once else []
        length = int(pipe.llen(keys.messages))
        pipe.multi()
        inbox.stage_received(pipe, keys, message_id, content)
        if waiting:
            pipe.rpush(keys.inbox, message_id)  # behind them, and all leave the inbox delivered in this EXEC
            inbox.stage_user_message(
                pipe, keys, None, [*waiting, (message_id, content)], turns=state.turns, index=length
            )
        elif at_once:
            _stage_append(pipe, keys, message_id, content, turns=state.turns, index=length)
        else:
            pipe.rpush(keys.inbox, message_id)
            Event.of(run_id, "message_queued", message=message_id, status=state.status, by=by).stage(pipe)
        if state.status in ("completed", "stopped"):
            for key in keys.kept():
                pipe.persist(key)  # a completed run had started its retention
            # The turn calls the model at once: the call its completing turn recorded, with these
            # messages, is reserved with its lease (as a turn's next one is).
            added = [{"role": "user", "content": c} for _, c in [*waiting, (message_id, content)]]
            stage_restart(
                pipe,
                r,
                run_id,
                turn=state.current_turn,
                attempt=0,
                requeues=header.requeues,
                fields={
                    "status": "running",
                    "phase": "model" if at_once else state.phase,
                    "error": "",
                    "model_errors": 0,
                },
                call=call_from_field(stop.get("next_call"), added) if at_once else None,
            )
            pipe.delete(keys.handback)
            Event.of(run_id, "status", status="running", reason="message", message=message_id, by=by).stage(pipe)
        writes.stage_remember(pipe, keys.run, write_id)
        fault("before_message_commit", run_id, 0)
        pipe.execute()
        fault("after_message_commit", run_id, 0)
        return message_id

    return writes.watched(r, [keys.run, keys.received, keys.inbox], attempt)


def _refusal(state: RunState, held_to: Limits | None) -> str:
    """Why a message to the run is refused ('' if it is not); ``held_to``: the limits a stopped or
    completed run was held to (``client.limits_held_to``)."""
    run_id, status = state.id, state.status
    if status in ("cancelled", "failed"):
        why = f" ({state.error})" if state.error else ""
        return (
            f"the run is {status}{why}; a {status} run takes no more messages (fork_run it to go on from its history)"
        )
    # A message would start a turn that stops at once, unanswered: raising a budget stays a person's
    # explicit act, whether a limit stopped the run or its last turn reached one as it completed.
    needs = held_to.needed_to_resume(state) if held_to else {}
    if held_to is None or not needs:
        return ""
    adds = ", ".join(f"{name}={value}" for name, value in needs.items())
    how = f"raise its limits first with resume({run_id!r}, {adds}), then send the message"
    if status == "stopped":
        return f"the run was stopped by a limit ({state.error}); {how}"
    used = "; ".join(held_to.exhausted(state).values())
    return f"the run completed at a limit ({used}); {how}"


def _stage_append(pipe: Any, keys: RunKeys, message_id: str, content: Any, *, turns: int, index: int) -> None:
    """In MULTI: the message becomes the run's next user message at ``index``, delivered now."""
    pipe.rpush(keys.messages, pack_message({"role": "user", "content": content}))
    pipe.hset(keys.received, f"{message_id}:at", f"{turns}:{index}")
    Event.of(keys.run_id, "message_delivered", messages=message_id, turn=turns).stage(pipe)


# What a fork keeps of its parent's header besides its agent, limits and queue: its tenant's concurrency
# key and limit (a fork counts against the same share) and its webhook (a fork's end is posted too).
INHERITED = ("ckey", "cmax", "webhook", "webhook_events")


@names_the_server
def fork_run(
    run_id: str,
    *,
    at_turn: int | None = None,
    fork_id: str | None = None,
    by: str | None = None,
    connection: Redis | str | shards.Shards | None = None,
) -> str:
    """A new run with ``run_id``'s conversation up to the end of its committed turn ``at_turn`` (the
    latest by default; a turn still in flight forks from the one before it, unless some of its tool
    calls or sub-agents have started: then a ``ValueError``), the same agent, limits, queue, concurrency
    key and webhook, ``forked_from``/``forked_at`` saying where it came from, and usage from zero.
    Returns its id.

    A fork from the latest committed turn also takes the messages waiting in the parent's inbox (sent,
    not yet delivered), delivered in the fork at once: its first model call sees them.

    Nothing of the parent runs again: the copy holds the tool_results of every copied turn, and the
    fork's ledger starts empty with no tool_use left pending. The parent is not changed. A fork whose
    copy ends with the model's final answer is ``completed`` (``result`` is that answer) and goes on
    when it is sent a message; one that ends with tool_results (or a paused reply) is queued and its
    next turn calls the model.

    Idempotent with ``fork_id``: a retried fork with the same id returns the run it made; that id
    used for anything else raises ``RunExists``. On a sharded pool the fork lives on its parent's shard.
    ``by`` names who forks: the fork's ``forked`` event keeps it."""
    by = optional_actor(by)
    if fork_id is not None:
        check_run_id(fork_id)  # before anything is read: a completed fork enqueues nothing to catch it
    r, shard = shards.located(connection, run_id)
    pool = shards.pool_of(connection)
    if fork_id is not None and pool is not None and shard is not None:
        # The fork goes to its parent's shard: its id must be free on all, now and while it is made.
        elsewhere = pool.find(fork_id)
        if elsewhere is not None and elsewhere != shard:
            raise RunExists(fork_id, f"on {pool.name(elsewhere)} and is not a fork of run {run_id}")
        if elsewhere is None:
            pool.claim(fork_id, shard)
    parent = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:  # one consistent snapshot of the parent
        pipe.hgetall(parent.run)
        pipe.lrange(parent.messages, 0, -1)
        pipe.lrange(parent.inbox, 0, -1)
        raw_header, blobs, waiting_ids = pipe.execute()
    state = checkpoint.decode_run(run_id, raw_header, None)
    messages = [unpack_message(blob, i) for i, blob in enumerate(blobs)]
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    committed = len(replies) - (1 if state.phase == "tools" else 0)
    if at_turn is not None and (
        not isinstance(at_turn, int) or isinstance(at_turn, bool) or at_turn < 0 or at_turn > len(replies)
    ):
        raise ValueError(f"at_turn must be a turn of run {run_id}: 0 to {committed}")
    # Asking for the turn in flight (not saved yet) is asking for the latest fork, and is checked as one.
    latest = at_turn is None or at_turn > committed
    turn = committed if at_turn is None else min(at_turn, committed)
    end = replies[turn] if turn < len(replies) else len(messages)
    # The latest fork of a run in its tool phase leaves the reply in flight out; if any of its calls has
    # started (a tool, a sub-agent's child run), that would be going back before an effect nobody asked
    # to undo (its model could ask for the same email again): refused, unless an earlier turn was named.
    in_flight = (
        [b["id"] for b in messages[end]["content"] if b.get("type") == "tool_use"]
        if latest and turn < len(replies)
        else []
    )
    # Messages the parent accepted but has not delivered yet come after all it committed: a fork of its
    # whole committed conversation keeps them (for a cancelled parent, the only way they are answered).
    ids = [i.decode() for i in waiting_ids] if turn == committed else []
    waiting = [(i, content) for i, content in inbox.with_contents(r, parent, ids) if content is not None]
    # A summary written at the start of the next turn belongs to that turn.
    while end > 1 and message_meta(blobs[end - 1], end - 1).get("compaction") == "summary":
        end -= 1
    last = messages[end - 1]
    meta = message_meta(blobs[end - 1], end - 1) if last["role"] == "assistant" else {}
    # Messages delivered after the final answer make a fork that answers them, not a completed one.
    finished = last["role"] == "assistant" and meta.get("stop_reason") in FINISHED_STOPS and not waiting
    window = max(
        [i for i in range(end) if is_compaction_point(messages[i])]
        + [i for i in range(end) if message_meta(blobs[i], i).get("compaction") == "summary"]
        + [0]
    )
    fork_id = fork_id or new_run_id(shard)
    # A fork created completed is held to its parent's limits (the same agent and limits): a message
    # to it is refused when they are used up, as it is for the parent.
    held_to = limits_held_to(r, run_id) if finished else None
    return _create_fork(
        r,
        fork_id,
        parent=run_id,
        turn=turn,
        asked="latest" if at_turn is None else str(at_turn),
        agent=state.agent,
        limits=state.limits,
        queue=state.queue,
        blobs=blobs[:end],
        window=window,
        result=trailing_text(messages[:end]) if finished else "",
        finished=finished,
        held_to=held_to.limit_fields() if held_to else {},
        waiting=waiting,
        unstarted=(parent, in_flight),
        inherited={name: raw_header[name.encode()] for name in INHERITED if name.encode() in raw_header},
        by=by,
    )


def _create_fork(
    r: Redis,
    fork_id: str,
    *,
    parent: str,
    turn: int,
    asked: str,
    agent: str,
    limits: dict[str, Any],
    queue: str,
    blobs: list[bytes],
    window: int,
    result: str,
    finished: bool,
    held_to: dict[str, Any],
    waiting: list[tuple[str, Any]],
    unstarted: tuple[RunKeys, list[str]],
    inherited: dict[str, bytes],
    by: str | None,
) -> str:
    """``waiting``: the parent's undelivered messages, delivered after the copy. ``unstarted``: the
    parent's keys and the calls left out of the copy that must not have started (checked under WATCH
    of its ledger and joins, so a tool or a child run that starts meanwhile is seen). ``inherited``:
    the parent's header fields in ``INHERITED``."""
    keys = RunKeys.of(fork_id)
    now = time.time()
    up, calls = unstarted

    def attempt(pipe: Pipeline, _write_id: str) -> str:  # a fork id is its own write id
        existing = pipe.hmget(keys.run, ["forked_from", "forked_at", "fork_asked"])
        if pipe.exists(keys.run):
            pipe.unwatch()
            # The same request retried: the turn it resolves to may have moved on since (the parent
            # committed a turn), so the request as asked is compared, not only the turn it gave.
            same_turn = existing[1] == str(turn).encode()
            if existing[0] == parent.encode() and (same_turn or existing[2] == asked.encode()):
                return fork_id  # a retried fork: it was created once
            raise RunExists(fork_id, f"and is not the fork of run {parent} at turn {turn}")
        if calls and (
            any(pipe.hmget(up.ledger, calls))
            or any(pipe.hmget(up.joins, [children.child_id(parent, call) for call in calls]))
        ):
            pipe.unwatch()
            raise ValueError(
                f"run {parent} is in the middle of the tool calls of its turn {turn + 1}, and some have run: "
                f"a fork now would leave them out and could make them again. Fork once the turn is saved, "
                f"or name at_turn={turn} to fork from before them"
            )
        header = new_header(agent, limits, now, queue)  # the fork's turns go where the parent's went
        traced_from = tracing.current_parent()  # the app's span, as for a run it enqueues
        header.update(inherited, **({tracing.PARENT_FIELD: traced_from} if traced_from else {}))
        header.update(
            turns=turn,
            window=window,
            forked_from=parent,
            forked_at=turn,
            fork_asked=asked,
            status="completed" if finished else "queued",
            phase="done" if finished else "model",
            result=pack_result(result),
        )
        pipe.multi()
        pipe.hset(keys.run, mapping=header)
        pipe.rpush(keys.messages, *blobs)
        pipe.zadd(RUNS, {fork_id: int(now * 1000)})
        if not finished:
            pipe.zadd(RUNS_WATCH, {fork_id: int(now * 1000) + checkpoint.QUEUED_RECHECK_MS})
            stage_turn(pipe, r, fork_id, turn, queue=queue)
        Event.of(fork_id, "forked", parent=parent, at_turn=turn, status=header["status"], **held_to, by=by).stage(pipe)
        for message_id, content in waiting:  # kept by id, as sent: a retried send to the fork finds it
            inbox.stage_received(pipe, keys, message_id, content)
        inbox.stage_user_message(pipe, keys, None, waiting, turns=turn, index=len(blobs))
        retention = Settings.from_env().retention
        if finished and retention > 0:
            for key in keys.kept():
                pipe.expire(key, retention)  # a completed run's retention starts now
        fault("before_fork_commit", fork_id, 0)
        pipe.execute()
        fault("after_fork_commit", fork_id, 0)
        return fork_id

    return writes.watched(r, [keys.run, up.ledger, up.joins] if calls else [keys.run], attempt)
