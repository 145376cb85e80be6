"""Loading a run and the save points that change it.

Save point A (``commit_response``) and the fenced status changes (``finish``) are Lua scripts. Save
point B (``commit_tool_results``) is one script too when nothing waits in the run's inbox: the enqueue
of the next turn (RQ's writes, described by ``agentpool.store.staged_job``) lands in the same call as
the tool results, so a crash leaves either the old turn pending or the new one committed *with its job
queued*; with messages to deliver, it is one WATCH/MULTI transaction that merges them in.

Every write here is safe to deliver twice (``store/writes.py``): the scripts carry a write id and
answer a re-delivery with the first delivery's result; the transactions record their write id and,
when redis-py raises ``WatchError`` because the connection dropped after EXEC was sent, look for it
before deciding whether to try again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import WatchError

from agentpool.store import inbox, ledger, webhooks, writes
from agentpool.store.clock import now_ms
from agentpool.store.codec import pack, safe_text, unpack
from agentpool.store.errors import (
    LeaseLost,
    MessagesWaiting,
    RunExists,
    RunNotActive,
    RunNotFound,
    SchemaTooNew,
    StoreError,
    TurnMoved,
    UnreadableRecord,
)
from agentpool.store.events import Event, script_args
from agentpool.store.keys import RUNS, RUNS_WATCH, STATS, RunKeys
from agentpool.store.ledger import Outcome
from agentpool.store.records import (
    SCHEMA_VERSION,
    TERMINAL_STATUSES,
    USAGE_FIELDS,
    RunState,
    header_version,
    load_header,
    new_header,
    pack_message,
    pack_pending,
    pack_result,
    unpack_message,
)
from agentpool.store.scripts import Rider, compact_source, run_script
from agentpool.store.staged_job import EndedJob, StagedJob, flat

if TYPE_CHECKING:
    from agentpool.store.spend import Rest

# How long a committed turn may wait in the queue before the reaper checks that its job still exists.
QUEUED_RECHECK_MS = 30_000
EAGER_TRIES = 20  # a fenced transaction's tries without a pause, while others change what it watches


def stage_create(
    pipe: Pipeline,
    run_id: str,
    *,
    agent: str,
    task: str,
    limits: Mapping[str, Any],
    now: float,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Add the commands that create a run to ``pipe`` (the caller adds the first turn's enqueue);
    ``extra`` header fields (its queue, say) are written with it."""
    keys = RunKeys.of(run_id)
    pipe.hset(keys.run, mapping={**new_header(agent, limits, now), **(extra or {})})
    pipe.rpush(keys.messages, pack_message({"role": "user", "content": task}))
    pipe.zadd(RUNS, {run_id: int(now * 1000)})
    pipe.zadd(RUNS_WATCH, {run_id: int(now * 1000) + QUEUED_RECHECK_MS})


def create_run(
    r: Redis,
    run_id: str,
    *,
    agent: str,
    task: str,
    limits: Mapping[str, Any],
    now: float,
    stage_enqueue: Callable[[Pipeline], None],
    extra: Mapping[str, Any] | None = None,
    event: Event | None = None,
) -> bool:
    """Create the run and its first turn's job (``stage_enqueue``), with ``event`` (its ``queued``
    status), in one transaction, unless a run with this id exists. Returns True if it was created now,
    False if it already existed for the very same request (agent, task, limits and the ``REQUEST_FIELDS``
    of ``extra``): a client retrying
    its enqueue gets the run it made. An existing run made for anything else raises RunExists; an
    existing run is never touched (its header, counters and fence stay as they are).

    Watched, so redis-py never re-sends it blindly: after a lost EXEC reply the next try finds the
    run it created, the same request, and returns without creating it twice."""
    keys = RunKeys.of(run_id)

    def attempt(pipe: Pipeline, write_id: str) -> bool:
        header = pipe.hgetall(keys.run)
        if header:
            pipe.unwatch()
            if writes.landed(header.get(writes.OTHERS.encode()), write_id):
                return True  # this very call created it; the reply to its EXEC was lost
            _check_same_request(r, run_id, header, agent=agent, task=task, limits=limits, extra=extra or {})
            return False
        pipe.multi()
        # The header is new (WATCHed, read empty): its ring of writes is this one alone, in its HSET.
        remembered = {writes.OTHERS: writes.ring_of_one(write_id)}
        stage_create(
            pipe, run_id, agent=agent, task=task, limits=limits, now=now, extra={**(extra or {}), **remembered}
        )
        stage_enqueue(pipe)
        if event:
            event.stage(pipe)
        pipe.execute()
        return True

    created = writes.watched(r, [keys.run], attempt)
    if created and event:
        event.landed()
    return created


# The header fields of a request (``enqueue_run``'s ``extra``) a retry must repeat: a retry that changed
# one would be told "done" for a run that does not do what it asked (another queue, no webhook, no cap).
# What they are when a request did not give them (new_header writes the queue; the others are left out).
REQUEST_FIELDS = {"queue": "default", "ckey": "", "cmax": "", "webhook": "", "webhook_events": ""}


def _check_same_request(
    r: Redis,
    run_id: str,
    header: Mapping[bytes, bytes],
    *,
    agent: str,
    task: str,
    limits: Mapping[str, Any],
    extra: Mapping[str, Any],
) -> None:
    """Compares what was asked with what is stored (the task is the first message, sealed or not):
    no digest of the task is kept beside it, which would let anyone with a dump test guesses."""
    if header.get(b"agent", b"").decode("utf-8", errors="replace") != agent:
        raise RunExists(run_id, f"for agent {header.get(b'agent', b'?').decode('utf-8', errors='replace')!r}")
    for name, unset in REQUEST_FIELDS.items():
        stored = header.get(name.encode(), b"").decode("utf-8", errors="replace") or unset
        asked = str(extra.get(name, "")) or unset
        if stored != asked:  # named, not shown: a webhook's URL may carry a token
            shown = {"ckey": "concurrency_key", "cmax": "max_concurrency"}.get(name, name)
            raise RunExists(run_id, f"with another {shown}")
    raw_limits = header.get(b"limits")
    try:
        stored = unpack(raw_limits, "run limits") if raw_limits else {}
    except UnreadableRecord:
        stored = None
    first = {name: stored.get(name) for name in ("max_turns", "max_total_tokens", "max_cost_usd")} if stored else {}
    if stored is None or {k: v for k, v in first.items() if v is not None} != dict(limits):
        raise RunExists(run_id, "with other limits")
    blob = r.lindex(RunKeys.of(run_id).messages, 0)
    try:
        stored_task = unpack_message(blob, 0)["content"] if blob else None
    except StoreError as exc:
        raise RunExists(run_id, f"and its task cannot be compared here ({exc})") from None
    if stored_task != task:
        raise RunExists(run_id, "with another task")


def stage_load(pipe: Pipeline, run_id: str, *, with_messages: bool = True) -> None:
    """Add the reads of a run to ``pipe``; ``decode_run`` turns their replies into its state."""
    keys = RunKeys.of(run_id)
    pipe.hgetall(keys.run)
    if with_messages:
        pipe.lrange(keys.messages, 0, -1)


def decode_run(run_id: str, header: Mapping[bytes, bytes], blobs: list[bytes] | None) -> RunState:
    """The state from the replies of ``stage_load``; ``blobs`` None when the messages were not read."""
    if not header:
        raise RunNotFound(run_id)
    state = load_header(run_id, header, open_sealed=blobs is not None)
    if blobs is not None:
        state.messages = [unpack_message(blob, i) for i, blob in enumerate(blobs)]
    return state


def load_run(r: Redis, run_id: str, *, with_messages: bool = True) -> RunState:
    """One round trip: the header and (optionally) the whole conversation."""
    with r.pipeline(transaction=False) as pipe:
        stage_load(pipe, run_id, with_messages=with_messages)
        replies = pipe.execute()
    return decode_run(run_id, replies[0], replies[1] if with_messages else None)


def ancestors_of(r: Redis | Pipeline, run_id: str) -> list[str]:
    """The runs above ``run_id``, its parent first (for a caller that has not loaded the run); a child
    made before ancestors were recorded has its parent alone."""
    ancestors, parent = r.hmget(RunKeys.of(run_id).run, ["ancestors", "parent"])
    return (ancestors or b"").decode().split() or ([parent.decode()] if parent else [])


def tree_keys(ancestors: Sequence[str]) -> list[str]:
    """A child run's keys for save point A beyond its own: its parent's header, joins hash, events, inbox
    and received hash (the join and a late answer: ``_join.lua``), then the headers of the ancestors
    above the parent (each call's spend is added to every ancestor's tree counters: ``_tree.lua``)."""
    if not ancestors:
        return []
    up = RunKeys.of(ancestors[0])
    return [up.run, up.joins, up.events, up.inbox, up.received, *(RunKeys.of(a).run for a in ancestors[1:])]


def parent_keys(r: Redis | Pipeline, run_id: str) -> list[str]:
    """The keys a child run's terminal write tells its parent through (header, joins, events; see
    ``store/lua/_join.lua``); [] for a run without a parent. The parent field is written once, with
    the child, so reading it before the write is safe."""
    raw = r.hget(RunKeys.of(run_id).run, "parent")
    if not raw:
        return []
    parent = RunKeys.of(raw.decode())
    return [parent.run, parent.joins, parent.events]


def _check(code: int, keys: RunKeys, r: Redis) -> None:
    if code == -5:
        raise MessagesWaiting(f"run {keys.run_id} has messages waiting in its inbox")
    if code in (-1, -6, -7):  # -6, -7: lost, its call counted already by the turn that took over
        raise LeaseLost(keys.run_id)
    if code == -2:
        raise RunNotActive(keys.run_id, (r.hget(keys.run, "status") or b"?").decode("utf-8", errors="replace"))
    if code == -3:
        raise LeaseLost(keys.run_id)  # the checkpoint moved on without us: same remedy, stop
    if code == -4:
        raise RunNotFound(keys.run_id)


def _ending_keys(keys: RunKeys, parent: Sequence[str]) -> list[str]:
    """KEYS of the scripts that can end a run (``commit_response``, ``finish``), laid out the way
    ``store/lua/_retention.lua`` reads them: the run's own keys, a child run's ``parent`` keys, then the
    webhook's two (``store/lua/_webhook.lua`` takes them off the end)."""
    return [
        keys.run,
        keys.lease,
        keys.messages,
        RUNS_WATCH,
        STATS,
        keys.events,
        keys.handback,
        keys.ledger,
        keys.approvals,
        keys.inbox,
        keys.received,
        keys.children,
        keys.joins,
        keys.webhooks,
        *parent,
        *webhooks.script_keys(keys),
    ]


def commit_response(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    turns_before: int,
    message: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
    pending: list[dict[str, Any]],
    final_status: str = "",
    result: str = "",
    error: str = "",
    retention_s: int = 0,
    usage: Mapping[str, int] | None = None,
    cost_usd: float = 0.0,
    closing: Mapping[str, Any] | None = None,
    responded: Event | None = None,
    event: Event | None = None,
    ancestors: Sequence[str] | None = None,
    late: tuple[str, bytes] | None = None,
    pool_webhook: str = "",
    intents: Sequence[tuple[str, Mapping[str, Any], Event]] = (),
    clear_handback: bool = True,
    riders: Sequence[Rider] = (),
    window: int | None = None,
    rest: Rest | None = None,
) -> int:
    """Save point A: count the call's ``usage`` and cost with the ``responded`` event, then commit
    its response with the ``event`` that reports it. The spend counts even when the response can no
    longer be committed (the run was cancelled meanwhile, or this worker lost its lease while the
    model answered): the call was made and billed, and usage covers every call paid for. Counted
    once: a worker that lost its lease records no ``responded`` event when the attempt that took the
    run over has counted the call already from its note (``agentpool.store.spend``), and counts only
    the ``rest`` of it (what the note did not know), in the same write.

    With a ``final_status`` the run ends in the same step; ``closing`` is then a user message
    appended after the response (the tool_results of tool_uses that will never run), so a run
    failed by its reply (a refusal holding a tool_use) keeps a valid conversation and no worker
    that takes over can mistake it for a turn to continue.

    A reply that would complete the run while messages wait in its inbox (``send_message``) raises
    ``MessagesWaiting`` having written nothing: the run must answer them first.

    A child run's spend is added to its ``ancestors``' tree counters in the same step (the run's
    ancestors, its parent first, as its turn loaded them; None: read here). ``late`` is the id and
    packed content of its answer for its parent, given when the reply completes a child run: queued
    in the parent's inbox if the parent's join had already ended (the child stopped and was resumed).
    A run that ends here records its webhook delivery in the same script: for its own webhook, or for
    the pool default when ``pool_webhook`` (the events the worker's ``AGENTPOOL_WEBHOOK_URL`` wants)
    names the event (``store/lua/_webhook.lua``).

    ``intents`` are ledger intents (tool_use id, record, its ``tool_started`` event) of read tools this
    worker runs right after: written with the pending they answer, they cost the tools no write of
    their own before they run (``agentpool.runtime.settle``, ``start_reads``).

    ``clear_handback``: delete the run's hand-back record (``store.handback``); False when the caller
    knows there is none (a turn that no re-enqueue brought: save point B deleted the last one).

    ``riders``: other scripts sent in the same round trip, after this one's (the call's rate-limit
    settle); each keeps its reply or error, and is sent whatever this one answers.

    ``window``: move the header's window there (``store.window``) with the commit: the reply's own index
    when the API compacted the conversation in it, or the compaction point the turn found past the
    header's. A reply that ends the run has no save point B to move it.

    Returns 2 when the run ended here and was the last open child of its parent (which is now due to
    be woken), 1 otherwise."""
    parent = tree_keys(ancestors_of(r, keys.run_id) if ancestors is None else ancestors)
    code = run_script.with_riders(
        "commit_response",
        r,
        _ending_keys(keys, parent),
        [
            token,
            turns_before,
            pack_message(message, meta),
            pack_pending(pending),
            now_ms(),
            keys.run_id,
            final_status,
            pack_result(result),
            error,
            SCHEMA_VERSION,
            retention_s,
            *(int((usage or {}).get(name) or 0) for name in USAGE_FIELDS),
            repr(float(cost_usd)),
            writes.new_id(),
            pack_message(closing) if closing else "",
            len(parent),
            *(late or ("", "")),
            "1" if clear_handback else "",
            "" if window is None else window,
            rest.script_arg() if rest else "",
            *script_args(responded, event),
            len(intents),
            *(x for tool_use_id, record, _ in intents for x in (tool_use_id, pack(record))),
            *script_args(*(started for _, _, started in intents)),
            pool_webhook,
        ],
        riders,
    )
    # -6, -7: the lease was lost and the attempt that took the run over had counted the call from its
    # note: nothing but its rest (-7) was counted or reported here.
    if int(code) not in (-4, -5, -6, -7) and responded:  # type: ignore[arg-type]
        responded.landed()
    if int(code) == -7 and rest:  # type: ignore[arg-type]
        rest.event.landed()
    _check(int(code), keys, r)  # type: ignore[arg-type]
    for landed in (event, *(started for _, _, started in intents)):
        if landed:
            landed.landed()
    return int(code)  # type: ignore[arg-type]


def header_int(value: bytes | None) -> int:
    """A counter field of the header (attempt, requeues) for a decision; a corrupt one raises."""
    try:
        return int(value or 0)
    except ValueError:
        raise UnreadableRecord(f"header field holds {value[:40]!r}, not a number") from None


def _fenced_transaction(
    r: Redis,
    keys: RunKeys,
    token: str,
    stage: Callable[..., None],
    read: Callable[[Pipeline], Any] | None = None,
    watch_also: tuple[str, ...] = (),
    at: ledger.At | None = None,
) -> None:
    """One EXEC that lands only while ``token`` owns the lease and the run is running (and, given
    ``at``, is at those turns and phase: ``TurnMoved`` otherwise); it drops the lease. ``stage(pipe, attempt, requeues)`` adds the caller's commands (in MULTI) given the header's
    attempt and requeue counters; with ``read``, also what ``read(pipe)`` found under WATCH (of the
    lease, the header and ``watch_also``) as a fourth argument.

    redis-py does not re-send a watched transaction: a connection that drops after EXEC was sent
    raises WatchError, as a watched key that changed does (the heartbeat's PEXPIRE of the lease, say).
    The transaction records a write id, and each try first asks whether an earlier one landed.

    It tries for as long as the lease is the turn's: a burst of messages sent to the run changes the
    watched keys again and again, and giving up then would abandon a turn nobody else may take until
    the lease expires. After ``EAGER_TRIES`` it pauses a little between tries."""
    write_id = writes.new_id()
    tries = 0
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.lease, keys.run, *watch_also)
                holder, status, attempt, requeues, done, turns, phase = run_script(  # type: ignore[misc]
                    "fence_state", pipe, [keys.lease, keys.run], [write_id]
                )
                if done:
                    pipe.unwatch()
                    return  # the EXEC of an earlier try landed; its reply was lost
                if holder != token.encode():
                    raise LeaseLost(keys.run_id)
                if status != b"running":
                    raise RunNotActive(keys.run_id, (status or b"?").decode("utf-8", errors="replace"))
                if at and (turns, phase) != (str(at[0]).encode(), at[1].encode()):
                    found_at = f"turn count {(turns or b'?').decode()}, phase {(phase or b'?').decode()}"
                    raise TurnMoved(keys.run_id, f"save point B follows turn count {at[0]}, the run is at {found_at}")
                found = read(pipe) if read else None
                pipe.multi()
                args = (found,) if read else ()
                stage(pipe, header_int(attempt), header_int(requeues), *args)
                pipe.delete(keys.lease, keys.handback)
                writes.stage_remember(pipe, keys.run, write_id, field=writes.FIELD)
                pipe.execute()
                return
            except WatchError:
                tries += 1
                if tries >= EAGER_TRIES:
                    time.sleep(min(0.2, 0.005 * (tries - EAGER_TRIES + 1)))


def commit_tool_results(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    message: Mapping[str, Any] | None,
    turns: int,
    enqueue_next: Callable[[Pipeline], None] | None = None,
    next_job: StagedJob | None = None,
    outcomes: dict[str, Outcome] | None = None,
    event: Event | None = None,
    tool_events: Sequence[Event] = (),
    ended_job: EndedJob | None = None,
) -> None:
    """Save point B: the tool results message (if any), phase back to "model", the lease dropped,
    the next turn's job and the events that report it (``tool_events``, then ``event``), all at once,
    only if the run is still at the ``turns`` its save point A counted (``TurnMoved`` otherwise). The
    ledger keeps only notes of ``outcomes`` from now on. The header is stamped with the schema version
    the message was written in, as save point A does.

    The next turn is ``next_job`` (its writes, made by the commit itself) or what ``enqueue_next``
    stages. With ``next_job`` and no message waiting in the run's inbox, it is one script call
    (``commit_results.lua``). Otherwise one WATCH/MULTI transaction: messages waiting in the inbox join
    that user message after its tool_results and leave the inbox in the same EXEC (the inbox is
    watched: one sent meanwhile makes the transaction read again), each marked delivered at ``turns``
    with a ``message_delivered`` event. A turn with neither results nor messages appends nothing.
    ``ended_job``: the RQ job this turn runs in, ended by the same write (its worker then has nothing
    left to write for it)."""
    recorded = [*tool_events, *([event] if event else [])]
    if next_job is not None and enqueue_next is None:
        if _commit_results_at_once(r, keys, token, message, turns, next_job, outcomes or {}, recorded, ended_job):
            for one in recorded:
                one.landed()
            return
        enqueue_next = next_job.stage  # messages wait in the inbox: the transaction below merges them
    assert enqueue_next is not None, "commit_tool_results needs next_job or enqueue_next"

    def read(pipe: Pipeline) -> tuple[list[tuple[str, Any]], int]:
        return inbox.read_for_delivery(pipe, keys)

    landed: list[str] = []

    def stage(pipe: Pipeline, attempt: int, requeues: int, found: tuple[list[tuple[str, Any]], int]) -> None:
        waiting, length = found
        landed[:] = inbox.stage_user_message(pipe, keys, message, waiting, turns=turns, index=length)
        ledger.stage_compaction(pipe, keys, outcomes or {}, now_ms() / 1000)
        fields = {"phase": "model", "pending": b"", "attempt": 0, "updated_at": now_ms(), "v": SCHEMA_VERSION}
        pipe.hset(keys.run, mapping=fields)
        pipe.zadd(RUNS_WATCH, {keys.run_id: now_ms() + QUEUED_RECHECK_MS})
        enqueue_next(pipe)
        if ended_job is not None:
            ended_job.stage(pipe)
        for one in recorded:
            one.stage(pipe)

    # Only on the save point A it follows: a promoted replica may hold the lease but not that A, and
    # tool_results appended there would answer tool_uses its conversation does not have.
    _fenced_transaction(r, keys, token, stage, read=read, watch_also=(keys.inbox,), at=(turns, "tools"))
    for one in recorded:
        one.landed()


def _commit_results_at_once(
    r: Redis,
    keys: RunKeys,
    token: str,
    message: Mapping[str, Any] | None,
    turns: int,
    job: StagedJob,
    outcomes: dict[str, Outcome],
    events: list[Event],
    ended: EndedJob | None,
) -> bool:
    """Save point B as one script call (``commit_results.lua``); False, having done nothing, when
    messages wait in the inbox. Safe to deliver twice (its write id is in the header's ring)."""
    now = now_ms()
    header = {**job.header, "v": SCHEMA_VERSION}
    reply = run_script(
        "commit_results",
        r,
        [
            *(keys.lease, keys.run, keys.inbox, keys.messages, keys.ledger, RUNS_WATCH, keys.events, STATS),
            *(keys.handback, job.job_key, job.queue_key, job.queues_key),
            *((ended.job_key, ended.registry_key) if ended else ()),
        ],
        [
            token,
            writes.new_id(),
            turns,
            pack_message(message) if message else "",
            now,
            now + QUEUED_RECHECK_MS,
            keys.run_id,
            job.job_id,
            int(job.at_front),
            int(job.register),
            *flat(ledger.compaction_notes(outcomes, now / 1000)),
            *flat(header),
            *flat(job.job_fields),
            len(events),
            *script_args(*events),
            ended.execution if ended else "",
        ],
    )
    code, *detail = reply  # type: ignore[misc]
    if code == -9:
        return False
    if code == -1:
        raise LeaseLost(keys.run_id)
    if code == -2:
        raise RunNotActive(keys.run_id, _text(detail[0]) or "?")
    if code == -3:
        found_at = f"turn count {_text(detail[0]) or '?'}, phase {_text(detail[1]) or '?'}"
        raise TurnMoved(keys.run_id, f"save point B follows turn count {turns}, the run is at {found_at}")
    return True


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def defer_turn(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    model_errors: int,
    delay_ms: int,
    enqueue_later: Callable[[Pipeline, int], None],
    reason: str = "",
) -> None:
    """Give the turn back after a transient model error, or to wait for a rate-limit budget or a
    concurrency slot: it runs again in ``delay_ms`` (``enqueue_later(pipe, n)`` records it as deferred,
    the run's n-th re-enqueue, in this transaction); no turn is counted and no worker waits.
    ``retry_at`` and ``retry_reason`` in the header say why it waits.

    Nor is an attempt counted: the header's ``attempt`` counts the starts of a turn that a crash cut
    short (a turn that kills its workers fails its run at ``MAX_TURN_ATTEMPTS``), and a turn given back
    on purpose ended cleanly. Model errors have their own cap (``model_errors``); a wait has none, and a
    tenant's turn may wait for its slot many times over."""

    def stage(pipe: Pipeline, _attempt: int, requeues: int) -> None:
        retry_at = now_ms() + delay_ms
        pipe.hset(
            keys.run,
            mapping={
                "model_errors": model_errors,
                "requeues": requeues + 1,
                "retry_at": retry_at,
                "retry_reason": reason,
                "updated_at": now_ms(),
            },
        )
        pipe.zadd(RUNS_WATCH, {keys.run_id: retry_at + QUEUED_RECHECK_MS})
        enqueue_later(pipe, requeues + 1)

    _fenced_transaction(r, keys, token, stage)


def finish(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    status: str,
    error: str = "",
    message: Mapping[str, Any] | None = None,
    phase: str = "",
    result: str = "",
    retention_s: int = 0,
    watch_at_ms: int | None = None,
    event: Event | None = None,
    pool_webhook: str = "",
) -> int:
    """Fenced end of a turn without a next one (a limit reached, a failure, a wait for a person),
    with the ``event`` that reports it, and the webhook delivery the status calls for (see
    ``commit_response``).

    ``retention_s`` applies only to statuses that are final; ``watch_at_ms`` keeps the run in the
    reaper's watch set until then (an approval that expires). A child run that ends here tells its
    parent in the same script; returns 2 when that made the parent due to be woken, 1 otherwise."""
    parent = parent_keys(r, keys.run_id) if status != "waiting_approval" else []
    code = run_script(
        "finish",
        r,
        _ending_keys(keys, parent),
        [
            token,
            status,
            error,
            now_ms(),
            keys.run_id,
            pack_message(message) if message else "",
            phase,
            pack_result(result),
            retention_s if status in TERMINAL_STATUSES else 0,
            "" if watch_at_ms is None else watch_at_ms,
            SCHEMA_VERSION,
            writes.new_id(),
            len(parent),
            *script_args(event),
            pool_webhook,
        ],
    )
    _check(int(code), keys, r)  # type: ignore[arg-type]
    if event:
        event.landed()
    return int(code)  # type: ignore[arg-type]


def _expire(pipe: Pipeline, keys: RunKeys, retention_s: int) -> None:
    if retention_s > 0:
        for key in keys.kept():
            pipe.expire(key, retention_s)


def fail_unfenced(r: Redis, run_id: str, reason: str, *, retention_s: int, pool_webhook: str = "") -> bool:
    """Fail a run without holding its lease (its records are unreadable, or its turn keeps dying),
    touching only its status and error fields; its keys expire after ``retention_s`` (0: kept), as
    every finished run's do, and its webhook delivery is recorded with it (see ``commit_response``). A
    run already finished (cancelled, say) is left as it is. Returns True if the run was failed now."""
    keys = RunKeys.of(run_id)
    others = [k for k in keys.kept() if k != keys.run]
    parent = parent_keys(r, run_id)
    return bool(
        run_script(
            "fail_unfenced",
            r,
            [keys.run, keys.lease, RUNS_WATCH, *others, *parent, *webhooks.script_keys(keys)],
            [reason, now_ms(), run_id, retention_s, len(parent), pool_webhook],
        )
    )


def set_status_unfenced(
    r: Redis,
    run_id: str,
    status: str,
    *,
    error: str = "",
    allowed_from: frozenset[str] | None = None,
    retention_s: int = 0,
    pool_webhook: str = webhooks.MAYBE,
) -> str:
    """A status change by a person (cancel): not fenced by a lease, checked against the current status.
    A final status records the run's webhook delivery in the same transaction (see ``commit_response``;
    an app does not know the workers' default webhook, hence ``maybe``: see ``store/lua/_webhook.lua``).

    Returns the status the run had. A turn in flight notices at its next fenced write. Safe to
    deliver twice: after a lost EXEC reply it finds its write id and returns the status it replaced.
    """
    keys = RunKeys.of(run_id)

    def attempt(pipe: Pipeline, write_id: str) -> str:
        current, recent, parent, version = pipe.hmget(keys.run, ["status", writes.OTHERS, "parent", "v"])
        done = writes.landed(recent, write_id)
        if done is not None:
            pipe.unwatch()
            return done
        if current is None:
            raise RunNotFound(run_id)
        if version is not None and header_version({b"v": version}) > SCHEMA_VERSION:
            # A newer agentpool's record (a rolling deploy): what its statuses mean is that version's to
            # say. Checked under WATCH, so a newer worker rewriting the run meanwhile is seen too.
            pipe.unwatch()
            raise SchemaTooNew(
                f"run {run_id} was written with schema version {int(version)}, and this agentpool understands "
                f"up to {SCHEMA_VERSION}: its status was not changed"
            )
        before = current.decode("utf-8", errors="replace")
        if before in TERMINAL_STATUSES or (allowed_from is not None and before not in allowed_from):
            pipe.unwatch()
            return before
        pipe.multi()
        pipe.hset(keys.run, mapping={"status": status, "error": safe_text(error), "updated_at": now_ms()})
        if status in TERMINAL_STATUSES:
            pipe.zrem(RUNS_WATCH, run_id)
            if parent:  # a child's end tells its parent in the same step (store/lua/child_ended.lua)
                up = RunKeys.of(parent.decode())
                pipe.eval(
                    compact_source("child_ended"),
                    5,
                    keys.run,
                    RUNS_WATCH,
                    up.run,
                    up.joins,
                    up.events,
                    run_id,
                    up.run_id,
                    now_ms(),
                )
            webhooks.stage_record(pipe, keys, status, pool_webhook)
            _expire(pipe, keys, retention_s)
        writes.stage_remember(pipe, keys.run, write_id, before)
        pipe.execute()
        return before

    return writes.watched(r, [keys.run], attempt)
