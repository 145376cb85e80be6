"""The Python API apps use: enqueue a run, read it, wait for it, cancel, resume and approve it."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.client import Pipeline

from agentpool.checks import check_actor, limit_value, optional_actor
from agentpool.runtime import shards, tracing
from agentpool.runtime.limits import Limits
from agentpool.runtime.progress import why_waiting
from agentpool.runtime.settings import RedisCredentialsRefused, Settings, client_for, names_the_server
from agentpool.store import (
    approvals,
    checkpoint,
    children,
    concurrency,
    events,
    inbox,
    ratelimit,
    runs_index,
    webhooks,
    writes,
)
from agentpool.store import window as run_window
from agentpool.store.codec import pack
from agentpool.store.errors import AgentPoolError, RedisUnreachable, RunNotFound, SchemaTooNew
from agentpool.store.events import Event, emit
from agentpool.store.keys import (
    DEFAULT_QUEUE,
    RUNS,
    RunKeys,
    check_concurrency_key,
    check_queue,
    check_run_id,
    shard_suffix,
)
from agentpool.store.records import ACTIVE_STATUSES, SCHEMA_VERSION, STATUSES, RunState, header_version, load_header
from agentpool.webhooks import check_events, check_url

if TYPE_CHECKING:
    from agentpool.agent import Agent

# What enqueues a turn (RQ) or loads an agent (pydantic) is imported by the functions that do: reading
# runs (`agentpool runs`, `show`) must not pay for them.


# ``list_runs``' status for a run whose record it cannot decode (not a status a run is ever in).
UNREADABLE = "unreadable"
LISTED_STATUSES = STATUSES | {UNREADABLE}


class RunTimeout(AgentPoolError):
    pass


class ResumeRefused(AgentPoolError):
    """``resume`` would not let another turn start: the run would stop again at once. The message
    says what to add ("the run has used 2 of max_turns=2; resume with add_turns>=1")."""


@dataclass
class Run:
    """A run as an app sees it. ``messages`` is the whole conversation (from ``get_run(id, window=True)``:
    only what the next request sends); ``window`` is what the next request sends, from the run's latest
    compaction point (``window_start``) on."""

    id: str
    agent: str
    status: str
    turns: int
    messages: list[dict[str, Any]]
    pending: list[dict[str, Any]]
    usage: dict[str, int]
    result: str | None
    error: str | None
    created_at: float
    updated_at: float
    limits: dict[str, Any] = field(default_factory=dict)
    cost_usd: float = 0.0
    awaiting_approval: list[dict[str, Any]] = field(default_factory=list)
    # For a queued or running run: what it waits for and since when (agentpool.runtime.progress):
    # kind (handed_back, waiting_for_replica, backoff, queued, in_progress, lost), note, since, until, reason, detail, worker.
    waiting: dict[str, Any] | None = None
    window_start: int = 0  # index in the whole conversation of the message the next request starts from
    messages_from: int = 0  # index of ``messages[0]`` in the whole conversation (0 unless loaded with window=True)
    forked_from: str | None = None  # the run this one was forked from (``fork_run``), at its turn ``forked_at``
    forked_at: int | None = None
    inbox: list[dict[str, Any]] = field(default_factory=list)  # messages sent that wait for delivery: id, content
    queue: str = "default"  # the queue its turns go to (``enqueue_run(..., queue=...)``)
    # Sub-agents: the parent run's id (None at the top of a tree) and the child runs this one started, in
    # tool_use order (``get_run`` fills them in; ``list_runs`` leaves ``children`` empty). ``usage`` and
    # ``cost_usd`` are the whole tree's (its ended children's included); ``own_usage``/``own_cost_usd`` its own.
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    own_usage: dict[str, int] = field(default_factory=dict)
    own_cost_usd: float = 0.0
    depth: int = 0
    # Completion webhook deliveries (``enqueue_run(..., webhook=...)`` or the pool default), oldest first:
    # id, event, status, state (pending, delivered, undelivered), attempts, error (the last failure),
    # waiting (why no worker makes it), times; ``get_run`` fills them in (see agentpool.store.webhooks).
    webhooks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def window(self) -> list[dict[str, Any]]:
        """The messages the next request sends: the whole conversation from its latest compaction point on."""
        return self.messages[self.window_start - self.messages_from :]

    @classmethod
    def from_state(cls, state: RunState, awaiting: set[str] | None = None) -> Run:
        pending = [{k: call[k] for k in ("id", "name", "input")} for call in state.pending]
        waiting = [call for call in pending if awaiting and call["id"] in awaiting]
        return cls(
            id=state.id,
            agent=state.agent,
            status=state.status,
            turns=state.turns,
            messages=state.messages,
            # While a person must decide, the calls awaiting the decision are what is pending.
            pending=waiting if state.status == "waiting_approval" else pending,
            usage=dict(state.usage),
            result=state.result or None,
            error=state.error or None,
            created_at=state.created_at,
            updated_at=state.updated_at,
            limits=dict(state.limits),
            cost_usd=state.cost_usd,
            awaiting_approval=waiting,
            forked_from=state.forked_from or None,
            forked_at=state.forked_at if state.forked_from else None,
            queue=state.queue,
            parent=state.parent or None,
            own_usage=dict(state.own_usage),
            own_cost_usd=state.own_cost_usd,
            depth=state.depth,
        )

    @property
    def total_tokens(self) -> int:
        return sum(self.usage.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_run_id(shard: int | None = None) -> str:
    """Sortable by creation, safe in URLs and RQ job ids (letters, digits, ``_`` and ``-``); on a sharded
    pool it ends with the shard the run lives on (``-s1``: ``agentpool.runtime.shards``)."""
    made = f"r_{int(time.time() * 1000):012x}{secrets.token_hex(5)}"
    return made if shard is None else made + shard_suffix(shard)


@names_the_server
def enqueue_run(
    agent: str,
    task: str,
    *,
    connection: Redis | str | shards.Shards | None = None,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
    max_cost_usd: float | None = None,
    run_id: str | None = None,
    check_agent: bool = True,
    queue: str = DEFAULT_QUEUE,
    concurrency_key: str | None = None,
    max_concurrency: int | None = None,
    webhook: str | None = None,
    webhook_events: tuple[str, ...] | list[str] = ("ended",),
) -> str:
    """Create a run of ``agent`` (an import path ``module:attribute``) on ``task`` and queue its
    first turn, atomically. Returns the run id. The limits, when given, override the agent's.

    The agent is loaded here first, as a worker will load it, so that a typo or a broken module is
    an ``AgentNotLoadable`` at once rather than a run no worker can take. An app that does not have
    the agents' code (it only enqueues for workers that do) passes ``check_agent=False``.
    ``queue`` names the queue every turn of the run goes to (``default``: RQ's queue ``agentpool``);
    ``agentpool worker urgent default`` serves ``urgent`` first. Lowercase letters, digits, ``_``, ``-``.

    ``concurrency_key`` (a tenant, say) with ``max_concurrency``: at most that many turns of the runs of
    that key are in flight across the pool at once; the others wait, holding no worker. A limit an
    operator set for the key (``agentpool limits set acme 5``) wins over ``max_concurrency``.

    ``webhook`` (an ``http://`` or ``https://`` URL): agentpool POSTs the run's summary there, signed with
    the workers' ``AGENTPOOL_WEBHOOK_SECRET``, when the run ends (completed, failed, stopped, cancelled;
    ``webhook_events=("ended", "waiting_approval")`` also when it starts waiting for a person), retried
    until the receiver answers 2xx, for a day; without it, the workers' pool default
    (``AGENTPOOL_WEBHOOK_URL``) if they have one. Check deliveries with ``agentpool.webhooks.verify``.

    Idempotent with your own ``run_id``: if that run exists for the same request (agent, task, limits,
    queue, webhook and its events, concurrency key and max_concurrency), its id is returned and the run is left as it is (a retried enqueue gets the run it made, never a
    second one); if it exists for anything else, ``RunExists`` is raised and nothing changes. An
    existing run is never reset."""
    from agentpool.agent import check_agent_path
    from agentpool.runtime.estimate import first_call
    from agentpool.runtime.jobs import job_id, stage_turn

    check_agent_path(agent)
    loaded = _check_loadable(agent) if check_agent else None
    if not isinstance(task, str) or not task.strip():
        raise ValueError("a run needs a non-empty task text")
    # The first turn's call, for its lease to reserve within the model's rate limits as every later
    # turn's is (the turn before writes it): known only where the agent was loaded.
    call = first_call(loaded, task) if loaded is not None else None
    limits = {
        name: limit_value(name, value, whole=whole)
        for name, value, whole in (
            ("max_turns", max_turns, True),
            ("max_total_tokens", max_total_tokens, True),
            ("max_cost_usd", max_cost_usd, False),
        )
        if value is not None
    }
    check_queue(queue)
    extra: dict[str, Any] = {"queue": queue}
    if concurrency_key is not None:
        extra["ckey"] = check_concurrency_key(concurrency_key)
        if max_concurrency is not None:
            extra["cmax"] = limit_value("max_concurrency", max_concurrency, whole=True)
    elif max_concurrency is not None:
        raise ValueError("max_concurrency needs a concurrency_key: the runs it limits together")
    if webhook is not None:
        extra["webhook"] = check_url(webhook)
        extra["webhook_events"] = ",".join(check_events(webhook_events))
    elif check_events(webhook_events) != ("ended",):
        raise ValueError("webhook_events needs a webhook: the URL they are posted to")
    if run_id is not None:
        check_run_id(run_id)
    r, shard = shards.home(connection, run_id, concurrency_key)  # one Redis, or the run's shard
    run_id = run_id if run_id is not None else new_run_id(shard)
    parent = tracing.current_parent()  # the app's span, the parent of the run's trace
    if parent:
        extra[tracing.PARENT_FIELD] = parent
    extra["job"] = job_id(run_id, 0)  # the first turn's job, written with the header (one HSET)

    def stage_enqueue(pipe: Pipeline) -> None:
        # RQ's enqueue joins the transaction; a new run's window starts at its first message.
        stage_turn(pipe, r, run_id, 0, queue=queue, window=0, with_header=False, call=call)

    checkpoint.create_run(
        r,
        run_id,
        agent=agent,
        task=task,
        limits=limits,
        now=time.time(),
        stage_enqueue=stage_enqueue,
        extra=extra,
        event=Event.of(run_id, "status", status="queued", agent=agent),
    )
    return run_id


class AgentNotLoadable(AgentPoolError, ValueError):
    """``enqueue_run`` cannot load the agent it was given: no worker could run it either, unless
    the workers have code this process has not (then pass ``check_agent=False``)."""


def _check_loadable(agent: str) -> Agent:
    from agentpool.runtime.loader import AgentNotFound, load_agent

    try:
        return load_agent(agent, add_cwd=False, connect_mcp=False)  # its MCP servers are the workers to start
    except AgentNotFound as exc:
        raise AgentNotLoadable(
            f"{exc}; fix the agent's path, or pass check_agent=False (agentpool enqueue --no-check-agent) "
            "if only the workers have its code"
        ) from None


@names_the_server
def get_run(run_id: str, *, connection: Redis | str | shards.Shards | None = None, window: bool = False) -> Run:
    """The run with its whole conversation, or with ``window=True`` only what its next request sends
    (from its latest compaction point: one read that does not grow with the run's history)."""
    r = shards.route(connection, run_id)
    if window:
        state = run_window.load(r, run_id)
        start = messages_from = state.window_start
    else:
        state = checkpoint.load_run(r, run_id)
        start, messages_from = run_window.start_of(state), 0
    awaiting = None
    if state.status == "waiting_approval":
        waits, decisions = approvals.read(r, RunKeys.of(run_id))
        awaiting = {i for i in waits if i not in decisions}
    run = Run.from_state(state, awaiting)
    run.window_start, run.messages_from = start, messages_from
    run.waiting = _waiting(r, run)
    run.inbox = inbox.waiting(r, RunKeys.of(run_id))
    run.children = children.children(r, RunKeys.of(run_id))
    run.webhooks = webhooks.deliveries(r, RunKeys.of(run_id))
    if run.status == "waiting_children":
        run.waiting = _waiting_children(r, run.id, run.children)
    return run


def _open_children(r: Redis, run_id: str, kids: list[str]) -> dict[str, str]:
    """The child runs ``run_id`` still waits for (its join open), each with its status."""
    joins = children.joins(r, RunKeys.of(run_id))
    open_ = [c for c in kids if joins.get(c) == "open"]
    with r.pipeline(transaction=False) as pipe:
        for child in open_:
            pipe.hget(RunKeys.of(child).run, "status")
        return {c: (s or b"").decode() for c, s in zip(open_, pipe.execute())}


def _waiting_children(r: Redis, run_id: str, kids: list[str]) -> dict[str, Any]:
    """What a run waiting for its child runs waits on: how many still run, and which wait for a person."""
    statuses = _open_children(r, run_id, kids)
    open_ = list(statuses)
    asking = [c for c, s in statuses.items() if s == "waiting_approval"]
    held = [c for c, s in statuses.items() if s == "stopped"]  # an open join: held by a tree's budget
    note = f"waiting for {len(open_)} of {len(kids)} child runs"
    if asking:
        note += f"; waiting for approval: {', '.join(asking)}"
    if held:
        note += f"; stopped until the tree's budget is raised (resume the run whose budget it is): {', '.join(held)}"
    return {"kind": "children", "note": note, "open": open_, "waiting_approval": asking, "held": held}


def run_tree(run_id: str, *, connection: Redis | shards.Shards | None = None, depth_limit: int = 12) -> dict[str, Any]:
    """The run and its child runs, recursively: ``{"id", "agent", "status", "cost_usd", "own_cost_usd",
    "tokens", "error", "held_by", "children": [...]}``, children in tool_use order; ``held_by`` names the
    run whose used-up budget holds a stopped child (resuming that run resumes it). Headers only (no conversation), so it reads
    without the encryption key; a child whose record expired shows with status ``expired``."""
    r = shards.route(connection, run_id)  # child runs live on their parent's shard

    def node(run_id: str, depth: int, joined: str | None = None) -> dict[str, Any]:
        raw = r.hgetall(RunKeys.of(run_id).run)
        if not raw:
            return {"id": run_id, "status": "expired", "children": []}
        state = load_header(run_id, raw, open_sealed=False)
        kids = children.children(r, RunKeys.of(run_id)) if depth < depth_limit else []
        joins = children.joins(r, RunKeys.of(run_id)) if kids else {}
        return {
            "id": run_id,
            "agent": state.agent,
            "status": state.status,
            "cost_usd": state.cost_usd,
            "own_cost_usd": state.own_cost_usd,
            "tokens": sum(state.usage.values()),
            "error": state.error or None,
            # Stopped with its parent's join open: held until the run whose budget ran out is resumed.
            "held_by": state.held if state.status == "stopped" and joined == "open" and state.held else None,
            "children": [node(kid, depth + 1, joins.get(kid)) for kid in kids],
        }

    return node(run_id, 0)


def _waiting(r: Redis, run: Run) -> dict[str, Any] | None:
    found = why_waiting(r, run.id, run.status)
    return found.to_dict() if found else None


@names_the_server
def wait_for_run(
    run_id: str,
    *,
    timeout: float = 300.0,
    connection: Redis | str | shards.Shards | None = None,
    poll: float = 0.2,
    after_message: str | None = None,
) -> Run:
    """Block until the run is no longer queued, running or waiting for its child runs, or until it
    waits for a person: its own ``waiting_approval``, or (still ``waiting_children``) a child run below it
    waiting for approval or held stopped by the tree's budget (``run.waiting["note"]`` names them).
    Raise RunTimeout after ``timeout`` s (finite, >= 0), saying what the run still waits for.

    With ``after_message`` (an id ``send_message`` returned), until the run has answered that message:
    it was delivered and the run has taken a turn since, and is no longer queued or running (or it was
    stopped, failed or cancelled, which the returned run says). A run that was ``completed`` when the
    message was sent does not count as answered; ``run.result`` is then the answer to the message."""
    check_wait_times(timeout, poll)
    r = shards.route(connection, run_id)
    check_waitable(r, run_id, after_message)
    deadline = time.monotonic() + timeout
    while True:
        state = waited_for(r, run_id, after_message)
        if state is None:
            return get_run(run_id, connection=r)
        if time.monotonic() >= deadline:
            raise timed_out(state, after_message, timeout, why_still(r, state))
        time.sleep(poll)


def check_wait_times(timeout: object, poll: object) -> None:
    """A wait's ``timeout`` (seconds, >= 0) and ``poll`` (> 0): a NaN would never time out, None or a
    string would fail midway with a bare TypeError."""
    for name, value, least in (("timeout", timeout, 0.0), ("poll", poll, None)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
        if value < 0 or (least is None and value == 0):
            raise ValueError(f"{name} must be {'>= 0' if least is not None else '> 0'} seconds, got {value!r}")


# The pieces of wait_for_run, shared with agentpool.aio's (which pauses with asyncio.sleep instead).
def check_waitable(r: Redis, run_id: str, after_message: str | None) -> None:
    """RunNotFound for a run that is not there; an error for a message id never sent to it."""
    if after_message is not None and not r.hexists(RunKeys.of(run_id).received, after_message):
        checkpoint.load_run(r, run_id, with_messages=False)
        raise AgentPoolError(f"no message {after_message!r} was sent to run {run_id}")


def waited_for(r: Redis, run_id: str, after_message: str | None) -> RunState | None:
    """None once the wait is over; else the run's header as it is now."""
    state = checkpoint.load_run(r, run_id, with_messages=False)
    keys = RunKeys.of(run_id)
    going_on = state.status in ACTIVE_STATUSES or state.status == "waiting_children"
    if state.status == "waiting_children" and after_message is None and _person_needed_below(r, run_id):
        # Its tree waits for a person (a child run waiting for approval, or held by the tree's
        # budget): nothing moves until somebody acts, as for the run's own waiting_approval.
        going_on = False
    if not going_on and (after_message is None or _answered(r, keys, after_message, state)):
        return None
    return state


def _person_needed_below(r: Redis, run_id: str, depth: int = 0) -> bool:
    """Whether a run below ``run_id`` that it still waits for (its join open, at any depth) waits for a
    person: ``waiting_approval``, or ``stopped`` with its join open (held by the tree's budget until
    somebody resumes the run whose budget it is)."""
    if depth > 12:  # as deep as run_tree looks; a deeper tree is waited for, not searched
        return False
    statuses = _open_children(r, run_id, children.children(r, RunKeys.of(run_id)))
    return any(
        status in ("waiting_approval", "stopped")
        or (status == "waiting_children" and _person_needed_below(r, child, depth + 1))
        for child, status in statuses.items()
    )


def why_still(r: Redis, state: RunState) -> str | None:
    """What a run a wait timed out on waits for (as ``get_run(...).waiting["note"]`` says), if known."""
    if state.status == "waiting_children":
        return str(_waiting_children(r, state.id, children.children(r, RunKeys.of(state.id)))["note"])
    if state.status == "waiting_approval":
        return f"waiting for a person's decision: agentpool approve {state.id}"
    found = why_waiting(r, state.id, state.status)
    return found.note if found else None


def timed_out(state: RunState, after_message: str | None, timeout: float, why: str | None = None) -> RunTimeout:
    waits_for = f" for an answer to message {after_message}" if after_message else ""
    because = f": {why}" if why else ""
    return RunTimeout(
        f"run {state.id} still {state.status}{waits_for} after {timeout:g} s (turn {state.turns}){because}"
    )


def _answered(r: Redis, keys: RunKeys, message_id: str, state: RunState) -> bool:
    if state.status in ("stopped", "failed", "cancelled"):
        return True  # no answer comes without somebody acting: the caller sees why
    delivered = inbox.delivery(r, keys, message_id)
    return delivered is not None and state.turns > delivered.turns


def _leave_lines(r: Redis, run_id: str) -> None:
    """A cancelled run leaves the lines it waits in: counted as ahead of the others, it would hold them
    back until its place expired. A concurrency key's (a slot's wake-up made for it would go nowhere, so
    the wake-up goes on to the next one, if a slot is free), and a model budget's: the line its deferred
    turn waits in for the call its deferral carries (its need out of what a newcomer waits for)."""
    from agentpool.runtime.jobs import DEFERRED_META, deferred_meta

    key, limit, turns, job, deferral = r.hmget(RunKeys.of(run_id).run, ["ckey", "cmax", "turns", "job", DEFERRED_META])
    if key:
        concurrency.leave_line(r, key.decode(), run_id)
        concurrency.wake_if_free(r, key.decode(), int(limit or 0))
    _, call = deferred_meta(deferral, (job or b"").decode(errors="replace"))
    if call and (turns or b"").isdigit():  # a deferral for the budget is made before the turn's model call
        ratelimit.leave_line(r, call[0], ratelimit.ticket_of(run_id, int(turns or 0)))


@names_the_server
def cancel_run(
    run_id: str,
    *,
    connection: Redis | str | shards.Shards | None = None,
    reason: str | None = None,
    by: str | None = None,
) -> str:
    """End a run that has not ended for good. A turn in flight notices at its next write and commits
    nothing further. A run already completed, failed or cancelled is left as it is. Returns the status
    the run had before.

    ``reason`` becomes the run's ``error`` (``cancelled by request``, or ``cancelled by alice`` when
    ``by`` names who cancels); ``by`` is kept in the ``status`` event of the run and of each child run
    cancelled with it.

    A run (or a child run below it) written by a newer agentpool, during a rolling deploy, is a
    ``SchemaTooNew`` and nothing is changed: cancel it with the newer agentpool."""
    by = optional_actor(by)
    reason = reason or (f"cancelled by {by}" if by else "cancelled by request")
    r = shards.route(connection, run_id)  # its child runs are on the same shard
    _refuse_newer_tree(r, run_id)
    return _cancel(r, run_id, reason, by)


def _refuse_newer_tree(r: Redis, run_id: str) -> None:
    """SchemaTooNew if the run or a run below it has a newer schema version than this agentpool's: what
    a status means there is that version's to say, so its tree is left whole rather than half cancelled."""
    below = [run_id]
    while below:
        current = below.pop()
        raw = r.hget(RunKeys.of(current).run, "v")
        version = header_version({b"v": raw}) if raw is not None else SCHEMA_VERSION
        if version > SCHEMA_VERSION:
            which = "it" if current == run_id else f"its child run {current}"
            raise SchemaTooNew(
                f"run {run_id} cannot be cancelled here: {which} was written with schema version {version}, and "
                f"this agentpool understands up to {SCHEMA_VERSION}; cancel it with the newer agentpool "
                "(nothing was changed)"
            )
        below += children.children(r, RunKeys.of(current))


def _cancel(r: Redis, run_id: str, reason: str, by: str | None = None) -> str:
    settings = Settings.from_env()
    before = checkpoint.set_status_unfenced(
        r,
        run_id,
        "cancelled",
        error=reason,
        retention_s=settings.retention,
        # This process may not have the workers' default webhook: "maybe" records the delivery for
        # it all the same, and a worker without one drops it (store/lua/_webhook.lua).
        pool_webhook=settings.pool_webhook or webhooks.MAYBE,
    )
    if before not in ("completed", "failed", "cancelled"):
        emit(r, run_id, "status", status="cancelled", error=reason, by=by)
        _leave_lines(r, run_id)
    # Its child runs are cancelled too (theirs in turn); a child's cancel tells this run, already ended.
    newer: list[str] = []
    for child in children.children(r, RunKeys.of(run_id)):
        try:
            _cancel(r, child, f"its parent run {run_id} was cancelled", by)
        except RunNotFound:
            continue  # an earlier turn's child whose record expired: the children after it are cancelled all the same
        except SchemaTooNew:
            # It (or a run below it) was rewritten by a newer worker since cancel_run looked (a rolling
            # deploy): left as it is, the others are cancelled all the same, and the caller is told.
            newer.append(child)
    from agentpool.runtime.subagents import wake_parent_of

    wake_parent_of(r, run_id)  # a cancelled child was maybe its parent's last open one
    if newer:
        raise SchemaTooNew(
            f"run {run_id} was cancelled, but not all the runs below it: a newer agentpool wrote child run(s) "
            f"{', '.join(newer)} (or runs below them) meanwhile; cancel those with the newer agentpool"
        )
    return before


@names_the_server
def resume(
    run_id: str,
    *,
    add_turns: int = 0,
    add_tokens: int = 0,
    add_usd: float = 0.0,
    by: str | None = None,
    connection: Redis | str | shards.Shards | None = None,
) -> Run:
    """Continue a ``stopped`` run from its checkpoint, raising its limits by the amounts given (a run
    stopped by repeated model errors or a spend-limit 429 needs none). ``by`` names who resumes it: the
    events of the resume (``status``, or ``limits_raised``) keep it.

    A run stopped by a limit must be given enough for one more turn: ``resume`` raises
    :class:`ResumeRefused` saying what is needed otherwise, and changes nothing. The check uses the
    limits the run was held to when it stopped (recorded by the worker).

    A run with sub-agents goes on with its tree, in the same step (``agentpool.runtime.tree``): every
    stopped run below it (through runs that have not ended for good) is resumed with the same amounts,
    so what is added to the parent is what the tree may spend. A child held because the tree's budget
    ran out goes on as if nothing had stopped (its answer becomes its parent's tool_result); a child
    that had stopped on a limit of its own (its parent got an error result) sends its answer to its
    parent as a message when it finishes, unless the parent has ended. A stopped child that would stop
    again at once on a limit of its own is left stopped (the ``tree_resumed`` event names it); one its
    parent still waits for makes ``resume`` refuse. A run held by an ancestor's budget is resumed by
    resuming that ancestor: ``resume`` of the held run alone is refused, saying which.

    A run that ``completed`` at a limit (its last turn used the last of its turns, tokens or money)
    refuses messages until its limits are raised: ``resume`` raises them the same way (enough for one
    more turn) and the run stays completed, with nothing to do until a message is sent to it."""
    from agentpool.runtime import tree
    from agentpool.runtime.takeover import read_header

    add_turns = limit_value("add_turns", add_turns, whole=True, zero_ok=True)
    add_tokens = limit_value("add_tokens", add_tokens, whole=True, zero_ok=True)
    add_usd = limit_value("add_usd", add_usd, zero_ok=True)
    by = optional_actor(by)
    r = shards.route(connection, run_id)
    keys = RunKeys.of(run_id)

    def short_of(state: RunState) -> str | None:
        held_to = limits_held_to(r, state.id)
        return held_to.short_of(state, adds) if held_to else None

    def attempt(pipe: Pipeline, write_id: str) -> bool:
        header = read_header(pipe, run_id)
        if header is None:
            raise RunNotFound(run_id)
        if writes.landed(header.writes, write_id):
            pipe.unwatch()
            return header.status == "completed"  # a resume that raised a completed run's limits
        state = checkpoint.load_run(pipe, run_id, with_messages=False)  # type: ignore[arg-type]
        held_to = limits_held_to(r, run_id)
        at_limit = state.status == "completed" and held_to is not None and bool(held_to.needed_to_resume(state))
        if state.status != "stopped" and not at_limit:
            raise AgentPoolError(
                f"run {run_id} is {state.status}; only a stopped run (or one completed at a limit) can be resumed"
            )
        holder = tree.held_by(pipe, state)
        if holder and tree.spent_ancestor(r, [holder]):
            raise ResumeRefused(
                f"run {run_id} was stopped because the budget of run {holder} for itself and its sub-agents is "
                f"used up: resume run {holder}, and this run goes on with it"
            )
        short = held_to and held_to.short_of(state, adds)
        if short:
            raise ResumeRefused(f"run {run_id} would stop again at once: {short}")
        if at_limit:
            assert held_to is not None
            limits = dict(state.limits)
            for name, extra in tree.EXTRA_OF.items():
                if adds[name]:
                    before = limits.get(extra, 0)
                    # A NaN an older version let in is replaced, not added to (NaN + x is NaN).
                    limits[extra] = (before if math.isfinite(before) else 0) + adds[name]
            pipe.multi()
            # Completed, it stays so: a message sent now becomes its next user message and is answered.
            # The limits it is held to from now on are recorded with the change, for send_message.
            pipe.hset(keys.run, "limits", pack(limits))
            raised = held_to.raised(adds).limit_fields()
            Event.of(run_id, "limits_raised", **adds_given, **raised, by=by).stage(pipe)
        else:
            pipe.watch(keys.joins)
            top = tree.resumed(pipe, state)
            try:
                below = tree.plan(pipe, state, short_of)
            except ValueError as exc:
                raise ResumeRefused(f"run {run_id} cannot go on: {exc}") from None
            pipe.multi()

            def resumed_event(run: tree.Resumed, reason: str) -> Event:
                status = "waiting_children" if run.waits else "running"
                return Event.of(run.state.id, "status", status=status, reason=reason, **adds_given, by=by)

            tree.stage(pipe, r, top, adds, resumed_event(top, "resumed"))
            for run in below.runs:
                tree.stage(pipe, r, run, adds, resumed_event(run, f"resumed with run {run_id}"))
            if below.runs or below.left:
                Event.of(
                    run_id,
                    "tree_resumed",
                    resumed=",".join(run.state.id for run in below.runs) or None,
                    left_stopped=",".join(below.left) or None,
                    why_left="; ".join(f"{child}: {why}" for child, why in below.left.items()) or None,
                    by=by,
                ).stage(pipe)
        writes.stage_remember(pipe, keys.run, write_id)
        pipe.execute()
        return at_limit

    adds = {"add_turns": add_turns, "add_tokens": add_tokens, "add_usd": add_usd}
    adds_given = {name: amount or None for name, amount in adds.items()}
    writes.watched(r, [keys.run], attempt)
    return get_run(run_id, connection=r)


def limits_held_to(r: Redis, run_id: str) -> Limits | None:
    """The limits a stopped or completed run was held to, from the ``status`` event its worker wrote
    when it stopped or completed (or the ``limits_raised`` event of a ``resume`` since, or for a fork
    created completed, its parent's, in its ``forked`` event); None when it stopped for another reason
    (model errors) or before this was recorded."""
    return held_by(last_stop(r, run_id))


def last_stop(r: Redis, run_id: str) -> dict[str, str]:
    """The latest event that says what a stopped or completed run was held to (``limits_held_to``): its
    ``status`` event, or a ``limits_raised`` or ``forked`` one since; empty if none of its last 20."""
    for _id, fields in events.latest(r, run_id, count=20):
        if fields.get("kind") in ("limits_raised", "forked", "status"):
            return fields
    return {}


def held_by(stop: Mapping[str, str]) -> Limits | None:
    """The limits ``last_stop``'s event recorded; None for a status other than stopped or completed."""
    if stop.get("kind") == "status" and stop.get("status") not in ("stopped", "completed"):
        return None
    return Limits.from_fields(stop)


def resume_needs(r: Redis, run_id: str) -> dict[str, int | float]:
    """The least ``resume`` must add for a stopped run (or a completed one, to answer a message) to
    take another turn (empty: nothing)."""
    held_to = limits_held_to(r, run_id)
    if held_to is None:
        return {}
    return held_to.needed_to_resume(checkpoint.load_run(r, run_id, with_messages=False))


def agent_matches(wanted: str, agent: str) -> bool:
    """``wanted`` names ``agent`` (``myapp.agents:refunds``) by its full path, by its attribute
    (``refunds``) or by its module or a package above it (``myapp.agents``, ``myapp``)."""
    module, _, attribute = agent.partition(":")
    return wanted in (agent, attribute) or module == wanted or module.startswith(wanted + ".")


def newest_first(pages: list[list[Run]], limit: int) -> list[Run]:
    """Several shards' lists of runs as one, newest first (by creation, then id), cut to ``limit``."""
    found = [run for page in pages for run in page]
    return sorted(found, key=lambda run: (run.created_at, run.id), reverse=True)[:limit]


@names_the_server
def list_runs(
    *,
    connection: Redis | str | shards.Shards | None = None,
    limit: int = 100,
    status: str | None = None,
    agent: str | None = None,
) -> list[Run]:
    """Newest first, headers only (``messages`` left empty). ``agent`` matches as ``agent_matches``
    says; an unknown ``status`` is a ValueError listing the valid ones. With a filter, the whole
    index is looked through (headers read in pipelined pages) until ``limit`` runs match. On a sharded
    pool, each shard's newest ``limit`` merged by creation time.

    A run whose header this agentpool cannot decode (written by a newer agentpool during a rolling
    deploy, or damaged) is listed with status ``unreadable``, ``error`` saying why, and its agent and
    queue (counters zero); ``status="unreadable"`` lists only those, another status leaves them out.
    ``get_run`` of it raises the same error (``SchemaTooNew`` or ``UnreadableRecord``)."""
    if status is not None and status not in LISTED_STATUSES:
        raise ValueError(f"unknown status {status!r}; valid: {', '.join(sorted(LISTED_STATUSES))}")
    pool = shards.pool_of(connection)
    if pool is not None:  # all of the runs or an error: a list short of a silent shard's runs would mislead
        refused: list[RedisCredentialsRefused] = []

        def shard_runs(r: Redis) -> list[Run]:
            try:
                return list_runs(connection=r, limit=limit, status=status, agent=agent)
            except RedisCredentialsRefused as exc:
                refused.append(exc)  # a wrong password is not a silent shard: raised below as it is
                return []

        pages, silent = shards.each_answering(pool, shard_runs)
        if refused:
            raise refused[0]
        if silent:
            raise RedisUnreachable(f"Redis unreachable at {silent[0]}")
        return newest_first([page for _shard, page in pages], limit)
    r = client_for(connection)

    def wanted(run_status: str, run_agent: str) -> bool:
        # Whether a run is unreadable shows only once its header is decoded: that filter reads them all.
        status_ok = not status or status == UNREADABLE or run_status == status
        return status_ok and (not agent or agent_matches(agent, run_agent))

    filtered = bool(status or agent)
    runs: list[Run] = []
    pages = runs_index.iter_headers(
        r,
        page=min(runs_index.PAGE, max(1, limit)) if not filtered else runs_index.PAGE,
        where=wanted if filtered else None,
    )
    for run_id, header in pages:
        if len(runs) >= limit:
            break
        try:
            run = Run.from_state(load_header(run_id, header, open_sealed=False))
        except AgentPoolError as exc:
            # Listed, not skipped: a run this agentpool cannot read (damaged, or written by a newer
            # one during a rolling deploy) must not vanish from the list, or nobody learns its id.
            if status in (None, UNREADABLE):
                runs.append(_unreadable(r, run_id, header, exc))
            continue
        if status == UNREADABLE:
            continue
        run.waiting = _waiting(r, run)
        runs.append(run)
    return runs


def _unreadable(r: Redis, run_id: str, header: dict[bytes, bytes], exc: AgentPoolError) -> Run:
    """A run ``list_runs`` cannot decode, as a Run with status ``unreadable`` and the reason in
    ``error``. Only fields that are plain text are taken from the header (the agent and queue: what a
    person needs to find whose run it is); the counters may be what does not decode."""

    def text(name: bytes) -> str:
        return header.get(name, b"").decode("utf-8", errors="replace")

    created = (r.zscore(RUNS, run_id) or 0) / 1000  # the index's time: the header's may be what is broken
    return Run(
        id=run_id,
        agent=text(b"agent"),
        status=UNREADABLE,
        turns=0,
        messages=[],
        pending=[],
        usage={},
        result=None,
        error=str(exc),
        created_at=created,
        updated_at=created,
        queue=text(b"queue") or DEFAULT_QUEUE,
    )


@names_the_server
def approve(
    run_id: str,
    tool_use_id: str | None = None,
    *,
    approved: bool = True,
    reason: str | None = None,
    by: str = "person",
    connection: Redis | str | shards.Shards | None = None,
) -> list[str]:
    """Decide on a call the run waits on (or, without ``tool_use_id``, on every one). A denied call
    gets an ``is_error`` tool_result carrying ``reason``. ``by`` names who decided (``alice``,
    ``ops-bot@example.com``): the decision record and the run's ``approval`` event keep it. Returns the
    tool_use ids decided."""
    from agentpool.runtime.approvals import decide

    return decide(
        shards.route(connection, run_id),
        run_id,
        None if tool_use_id is None else [tool_use_id],
        approved=approved,
        reason=reason or "",
        by=check_actor(by),
    )
