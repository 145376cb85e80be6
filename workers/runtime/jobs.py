"""Turn jobs on the RQ queue: their ids, and the one place they are enqueued.

A job carries only ``(run_id, turn)``; the checkpoint in Redis is the truth. Ids are deterministic:
``<run>-t0007`` for the job save point B enqueues, ``<run>-t0007-r12`` for the run's 12th re-enqueue
(a takeover, a deferred model retry, a resume, a person's decision, a hand-back's retry), numbered by
the header's ``requeues`` counter under WATCH: every re-enqueue gets an id of its own.

A turn deferred to later (a model retry's backoff) is not an RQ job until it is due: it is recorded in
``ap:turns:deferred`` (``agentpool.runtime.deferred``), and the reaper, which runs in every worker and
scans every second, enqueues it then under the same id. RQ's scheduler is not used: its role lives in
one worker under a 61 s lock that the others retry only every 10 minutes (see FACTS.md), so a killed
holder would stall every deferred turn of the pool.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.client import Pipeline

from agentpool.runtime.serializer import MsgpackSerializer
from agentpool.runtime.settings import Settings
from agentpool.store.clock import now_ms
from agentpool.store.codec import pack, unpack
from agentpool.store.errors import UnreadableRecord
from agentpool.store.keys import DEFAULT_QUEUE, QUEUE_NAME, TURN_QUEUE, TURNS_DEFERRED, RunKeys, rq_queue_name
from agentpool.store.scripts import run_script
from agentpool.store.staged_job import EndedJob, StagedJob

if TYPE_CHECKING:
    from rq import Queue
    from rq.job import Job

TURN_FUNC = "agentpool.runtime.turn.run_turn"
RESULT_TTL = 0  # a turn job returns nothing worth keeping (and its job hash is deleted as it ends)
FAILURE_TTL = 7 * 24 * 3600


QUEUE_REGISTERED_EVERY = 60.0  # seconds between re-adding a queue to RQ's set of queues (``rq info`` lists it)
_registered: dict[str, float] = {}  # queue key -> when this process last added it to RQ's set

MAX_QUEUES_REMEMBERED = 10_000
_queues: dict[str, str] = {}  # run id -> its queue: set when the run is made, never changed


def turn_queue(r: Redis, queue: str = DEFAULT_QUEUE) -> Queue:
    """The RQ queue of agentpool's queue ``queue`` (``default``: RQ's ``agentpool``)."""
    from rq import Queue  # here: reading a run (`agentpool runs`, `show`) needs no RQ

    return Queue(rq_queue_name(queue), connection=r, serializer=MsgpackSerializer)


def agentpool_queues(r: Redis) -> list[str]:
    """The RQ names of agentpool's queues that exist (``agentpool`` always first, then by name): those in
    RQ's set of queues, where every enqueue of a turn adds its queue (``QUEUE_REGISTERED_EVERY``)."""
    from rq import Queue

    prefix = Queue.redis_queue_namespace_prefix
    found = {
        key.decode()[len(prefix) :]
        for key in r.smembers(Queue.redis_queues_keys)
        if key.decode().startswith(prefix + TURN_QUEUE)
    }
    others = sorted(n for n in found if n.startswith(TURN_QUEUE + "-"))
    return [TURN_QUEUE, *others]


def queue_of(r: Redis, run_id: str) -> str:
    """The run's queue (its header's ``queue``; none: ``default``), remembered in this process: a run's
    queue never changes, so every turn, takeover, hand-back and deferred turn goes back to it."""
    queue = _queues.get(run_id)
    if queue is None:
        raw = (r.hget(RunKeys.of(run_id).run, "queue") or b"").decode("utf-8", errors="replace")
        queue = raw if QUEUE_NAME.match(raw) else DEFAULT_QUEUE
        if len(_queues) >= MAX_QUEUES_REMEMBERED:
            _queues.clear()
        _queues[run_id] = queue
    return queue


def carried_by_deferrals(
    r: Redis, turns: list[tuple[str, int, int]]
) -> list[tuple[int | None, tuple[str, int, int] | None]]:
    """For deferred turns ``(run, turn, n)`` due to be enqueued (the reaper's batch), in one round trip:
    the window and call each one's deferral carried (``deferred_meta``), and its run's queue, remembered
    for ``queue_of``."""
    with r.pipeline(transaction=False) as pipe:
        for run_id, _, _ in turns:
            pipe.hmget(RunKeys.of(run_id).run, ["queue", DEFERRED_META])
        found = pipe.execute()
    carried = []
    for (run_id, turn, attempt), (raw_queue, raw_meta) in zip(turns, found, strict=True):
        queue = (raw_queue or b"").decode("utf-8", errors="replace")
        remember_queue(run_id, queue if QUEUE_NAME.match(queue) else DEFAULT_QUEUE)
        carried.append(deferred_meta(raw_meta, job_id(run_id, turn, attempt)))
    return carried


def remember_queue(run_id: str, queue: str) -> None:
    """What the run's header says (it was just read or written): no need to ask Redis for it later."""
    if len(_queues) >= MAX_QUEUES_REMEMBERED:
        _queues.clear()
    _queues[run_id] = queue


def job_id(run_id: str, turn: int, attempt: int = 0) -> str:
    """``attempt`` is the run's re-enqueue number (its header's ``requeues``), 0 for save point B's job."""
    base = f"{run_id}-t{turn:04d}"
    return f"{base}-r{attempt}" if attempt else base


# What job_id makes (run id, turn, re-enqueue): a guess at a turn job from its id alone (its function
# tells for sure).
TURN_JOB_ID = re.compile(r"(.+)-t(\d{4,})(-r\d+)?")


def turn_of_job_id(job_id: str) -> tuple[str, int] | None:
    """The run and turn a turn job's id names (see ``job_id``); None for another id."""
    matched = TURN_JOB_ID.fullmatch(job_id)
    return (matched.group(1), int(matched.group(2))) if matched else None


def requeued(job: Job | None) -> bool:
    """Whether ``job`` re-enqueued its turn (a takeover, a hand-back's retry, a resume...: every re-enqueue
    has a ``-r<n>`` id) rather than being the run's first job or the one its last save point B staged.
    Only a re-enqueued turn can follow a hand-back; None (a turn run outside RQ) counts as one."""
    if job is None:
        return True
    matched = TURN_JOB_ID.fullmatch(job.id)
    return matched is None or matched.group(3) is not None


def deferred_member(run_id: str, turn: int, attempt: int) -> str:
    """The turn's entry in ``ap:turns:deferred``; ``:`` cannot occur in a run id (RQ's job id rule)."""
    return f"{run_id}:{turn}:{attempt}"


def parse_deferred_member(member: str) -> tuple[str, int, int] | None:
    run_id, _, rest = member.partition(":")
    turn, _, attempt = rest.partition(":")
    if not (run_id and turn.isdigit() and attempt.isdigit()):
        return None
    return run_id, int(turn), int(attempt)


# The run header's field that carries a deferred turn's job meta until the reaper enqueues it:
# ``[job id, window, call]`` (msgpack). The job id ties it to the one deferral that wrote it: a later
# re-enqueue has another id, and an entry written before this field existed finds none.
DEFERRED_META = "deferred_job"


def carried_call(job: Job | None) -> Any:
    """The model call the job's meta says the turn is to make (``runtime.ratelimit.next_call``), if any:
    checked where it is reserved, only passed on here."""
    return (job.meta or {}).get("call") if job is not None else None


def carried_call_of(r: Redis, jid: str) -> Any:
    """``carried_call`` of a job known by its id alone (the reaper's takeover after a lease expired):
    its meta field read alone. None if the job hash is gone or its meta does not decode: the turn that
    takes over then reserves its call on its own, as it did before."""
    from rq.job import Job

    raw = r.hget(Job.key_for(jid), "meta")
    try:
        meta = MsgpackSerializer.loads(raw) if raw else None
    except UnreadableRecord:
        return None
    return meta.get("call") if isinstance(meta, dict) else None


def deferred_meta(raw: bytes | None, jid: str) -> tuple[int | None, tuple[str, int, int] | None]:
    """(window, call) the header's ``DEFERRED_META`` carries for job ``jid``; (None, None) if it carries
    nothing for that job, or nothing readable (the turn then reads its window and reserves its call
    itself, as any re-enqueued turn does)."""
    try:
        carried_jid, window, call = unpack(raw, "deferred job") if raw else ("", None, None)
    except (UnreadableRecord, TypeError, ValueError):
        return None, None
    if carried_jid != jid:
        return None, None
    if type(window) is not int or window < 0:
        window = None
    counts = call[1:] if isinstance(call, list) and len(call) == 3 and isinstance(call[0], str) else []
    if not counts or any(type(n) is not int or n < 1 for n in counts):
        return window, None
    return window, (call[0], counts[0], counts[1])


def turn_job(
    r: Redis,
    run_id: str,
    turn: int,
    attempt: int = 0,
    *,
    at_front: bool = False,
    queue: str | None = None,
    window: int | None = None,
    call: tuple[str, int, int] | None = None,
) -> StagedJob:
    """The turn's RQ job on the run's queue (``queue``, or the one its header names), as the writes that
    enqueue it: its hash as RQ writes it (one HSET; its result is not kept) and the push, ``at_front``
    at the head of the queue (RQ's ``LPUSH``), ahead of every turn waiting; the queue is added to RQ's
    set of queues when this process has not lately (``keep_queues_registered``). The run's header
    names the job (``job``): the reaper checks that job is still alive. ``window``: where the run's
    window starts, when the caller knows (the turn before): the turn reads its messages from there with
    the lease, without reading the header's ``window`` first. ``call``: the model call the turn is to
    make, as (model, input tokens, output tokens) its rate-limit reservation needs, when the turn
    before knows it: the turn reserves it with its lease (``agentpool.runtime.ratelimit``)."""
    from rq.job import JobStatus
    from rq.utils import now

    jid = job_id(run_id, turn, attempt)
    rq_queue = turn_queue(r, queue or queue_of(r, run_id))
    job = rq_queue.create_job(
        TURN_FUNC,
        args=(run_id, turn),
        # In the job's meta, not its args: a worker of an older release ignores it (a rolling deploy).
        meta={k: v for k, v in (("window", window), ("call", call)) if v is not None} or None,
        job_id=jid,
        timeout=int(Settings.from_env().turn_timeout),
        result_ttl=RESULT_TTL,
        failure_ttl=FAILURE_TTL,
        description=f"agentpool turn {turn} of {run_id}",
    )
    job.origin, job.enqueued_at, job._status = rq_queue.name, now(), JobStatus.QUEUED
    register = time.monotonic() - _registered.get(rq_queue.key, -QUEUE_REGISTERED_EVERY) >= QUEUE_REGISTERED_EVERY
    if register:
        _registered[rq_queue.key] = time.monotonic()
    return StagedJob(
        job_id=jid,
        job_key=job.key,
        # RQ writes every field, most of them empty for a job not yet run; it reads a missing one as empty.
        job_fields={name: value for name, value in job.to_dict().items() if value != ""},
        queue_key=rq_queue.key,
        queues_key=rq_queue.redis_queues_keys,
        register=register,
        at_front=at_front,
        header={"job": jid},
        header_key=RunKeys.of(run_id).run,
    )


def enqueue_turn(
    pipe: Pipeline,
    r: Redis,
    run_id: str,
    turn: int,
    attempt: int = 0,
    *,
    at_front: bool = False,
    queue: str | None = None,
    window: int | None = None,
    call: tuple[str, int, int] | None = None,
) -> str:
    """Add the turn's RQ job (``turn_job``, with its ``window`` and ``call`` when known) to ``pipe``, a
    MULTI (``pipe.multi()`` is called if the caller watches keys and has not, as RQ's own enqueue does).
    The run's header is left as it is."""
    job = turn_job(r, run_id, turn, attempt, at_front=at_front, queue=queue, window=window, call=call)
    return _stage(pipe, job, with_header=False)


def _stage(pipe: Pipeline, job: StagedJob, *, with_header: bool) -> str:
    if getattr(pipe, "watching", False) and not pipe.explicit_transaction:
        pipe.multi()
    job.stage(pipe, with_header=with_header)
    return job.job_id


def keep_queues_registered(pipe: Pipeline, queues: list[Queue]) -> None:
    """Add ``queues`` to RQ's set of queues if this process has not for a while (a worker's heartbeat:
    its forked horses inherit the note, so the turns they enqueue register nothing)."""
    for queue in queues:
        if time.monotonic() - _registered.get(queue.key, -QUEUE_REGISTERED_EVERY) >= QUEUE_REGISTERED_EVERY / 2:
            pipe.sadd(queue.redis_queues_keys, queue.key)
            _registered[queue.key] = time.monotonic()


def stage_turn(
    pipe: Pipeline,
    r: Redis,
    run_id: str,
    turn: int,
    attempt: int = 0,
    *,
    delay: float = 0.0,
    at_front: bool = False,
    queue: str | None = None,
    window: int | None = None,
    with_header: bool = True,
    call: tuple[str, int, int] | None = None,
) -> str:
    """Add the turn's job to ``pipe``, a transaction (already in MULTI) the caller executes with its own
    writes. ``attempt`` names the job as the run's n-th re-enqueue (see ``job_id``). With ``delay``, the
    turn is recorded as due in ``delay`` seconds instead, in the same transaction; the reaper enqueues it
    then, carrying ``window`` and ``call`` (``deferred_meta``). ``at_front``: ahead of every turn waiting
    (see ``enqueue_turn``). The job goes on the run's queue: ``queue`` when the caller knows it (a run
    being made does not have its header yet), else the one its header names. ``window``: where the run's window starts, when the caller knows (see
    ``turn_job``). ``with_header=False``: the caller writes the header's ``job`` field (``job_id``) itself.
    ``call``: the model call the turn is to make, for its lease to reserve (see ``turn_job``)."""
    if delay > 0:
        jid = job_id(run_id, turn, attempt)
        # The reaper checks this job is still alive, and builds it from the carried meta once it is due.
        header = {"job": jid, DEFERRED_META: pack([jid, window, call])}
        pipe.hset(RunKeys.of(run_id).run, mapping=header)
        pipe.zadd(TURNS_DEFERRED, {deferred_member(run_id, turn, attempt): now_ms() + int(delay * 1000)})
        return jid
    job = turn_job(r, run_id, turn, attempt, at_front=at_front, queue=queue, window=window, call=call)
    return _stage(pipe, job, with_header=with_header)


def note_execution(job: Job, registry_key: str, execution: str) -> None:
    """The worker started ``job`` (a turn job, with RQ's lean bookkeeping: ``agentpool.worker.lean``) as
    ``execution`` in the started registry ``registry_key``: its turn's save point B can end it."""
    job._agentpool_end = EndedJob(job.key, registry_key, execution)  # type: ignore[attr-defined]


def ending_of(job: Job | None) -> EndedJob | None:
    """How ``job``'s end is written, if its worker noted its execution (``note_execution``)."""
    return getattr(job, "_agentpool_end", None)


def mark_ended(job: Job) -> None:
    """The turn's save point B ended ``job`` (``EndedJob``): its worker has nothing left to write for it."""
    job._agentpool_ended = True  # type: ignore[attr-defined]


def ended_by_turn(job: Job) -> bool:
    return bool(getattr(job, "_agentpool_ended", False))


def give_back(r: Redis, queue: Queue, job_id: str, claimed: str = "") -> bool:
    """Put a job this worker dequeued (RQ moved it to the queue's intermediate list) but will not run
    back at the head of ``queue``, for another worker; ``claimed``: its member in the queue's started
    registry, if the worker claimed it (``agentpool.worker.lean``). Safe to deliver twice. False if it
    was in neither."""
    keys = [queue.intermediate_queue_key, queue.key, queue.started_job_registry.key]
    return bool(run_script("give_back_job", r, keys, [job_id, claimed]))
