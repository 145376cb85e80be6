"""Loading a run and the save points that change it.

Save point A (``commit_response``) and the fenced status changes (``finish``) are Lua scripts. Save
point B (``commit_tool_results``) is one WATCH/MULTI transaction, because the enqueue of the next turn
(RQ's own commands, given to us as a callback) must land in the same EXEC as the tool results: a crash
leaves either the old turn pending or the new one committed *with its job queued*.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import WatchError

from agentpool.store import ledger
from agentpool.store.clock import now_ms
from agentpool.store.codec import safe_text
from agentpool.store.errors import LeaseLost, RunNotActive, RunNotFound
from agentpool.store.events import Event, script_args
from agentpool.store.keys import RUNS, RUNS_WATCH, STATS, RunKeys
from agentpool.store.ledger import Outcome
from agentpool.store.records import (
    SCHEMA_VERSION,
    TERMINAL_STATUSES,
    USAGE_FIELDS,
    RunState,
    load_header,
    new_header,
    pack_message,
    pack_pending,
    pack_result,
    unpack_message,
)
from agentpool.store.scripts import run_script

# How long a committed turn may wait in the queue before the reaper checks that its job still exists.
QUEUED_RECHECK_MS = 30_000


def stage_create(pipe: Pipeline, run_id: str, *, agent: str, task: str, limits: Mapping[str, Any], now: float) -> None:
    """Add the commands that create a run to ``pipe`` (the caller adds the first turn's enqueue)."""
    keys = RunKeys.of(run_id)
    pipe.hset(keys.run, mapping=new_header(agent, limits, now))
    pipe.rpush(keys.messages, pack_message({"role": "user", "content": task}))
    pipe.zadd(RUNS, {run_id: int(now * 1000)})
    pipe.zadd(RUNS_WATCH, {run_id: int(now * 1000) + QUEUED_RECHECK_MS})


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


def _check(code: int, keys: RunKeys, r: Redis) -> None:
    if code == -1:
        raise LeaseLost(keys.run_id)
    if code == -2:
        raise RunNotActive(keys.run_id, (r.hget(keys.run, "status") or b"?").decode())
    if code == -3:
        raise LeaseLost(keys.run_id)  # the checkpoint moved on without us: same remedy, stop


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
    responded: Event | None = None,
    event: Event | None = None,
) -> None:
    """Save point A: count the call's ``usage`` and cost with the ``responded`` event, then commit
    its response with the ``event`` that reports it. The spend counts even when the response can no
    longer be committed (the run was cancelled meanwhile): the call was made and billed."""
    code = run_script(
        "commit_response",
        r,
        [keys.run, keys.lease, keys.messages, RUNS_WATCH, STATS, keys.events, keys.ledger, keys.approvals],
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
            *script_args(responded, event),
        ],
    )
    if int(code) != -1 and responded:  # type: ignore[arg-type]
        responded.log()
    _check(int(code), keys, r)  # type: ignore[arg-type]
    if event:
        event.log()


def _fenced_transaction(
    r: Redis, keys: RunKeys, token: str, stage: Callable[[Pipeline, int], None], retries: int = 20
) -> None:
    """One EXEC that lands only while ``token`` owns the lease and the run is running; it drops the
    lease. ``stage(pipe, attempt)`` adds the caller's commands (in MULTI) given the header's attempt."""
    with r.pipeline(transaction=True) as pipe:
        for _ in range(retries):
            try:
                # The heartbeat's PEXPIRE also touches the watched lease: that retries, it does not fail.
                pipe.watch(keys.lease, keys.run)
                holder, status, attempt = run_script("fence_state", pipe, [keys.lease, keys.run], [])  # type: ignore[misc]
                if holder != token.encode():
                    raise LeaseLost(keys.run_id)
                if status != b"running":
                    raise RunNotActive(keys.run_id, (status or b"?").decode())
                pipe.multi()
                stage(pipe, int(attempt or 0))
                pipe.delete(keys.lease)
                pipe.execute()
                return
            except WatchError:
                continue
    raise LeaseLost(keys.run_id)


def commit_tool_results(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    message: Mapping[str, Any] | None,
    enqueue_next: Callable[[Pipeline], None],
    outcomes: dict[str, Outcome] | None = None,
    event: Event | None = None,
) -> None:
    """Save point B: the tool results message (if any), phase back to "model", the lease dropped,
    the next turn's job and the ``event`` that reports it, all in one EXEC. The ledger keeps only
    notes of ``outcomes`` from now on."""

    def stage(pipe: Pipeline, attempt: int) -> None:
        if message is not None:
            pipe.rpush(keys.messages, pack_message(message))
        ledger.stage_compaction(pipe, keys, outcomes or {}, now_ms() / 1000)
        pipe.hset(keys.run, mapping={"phase": "model", "pending": b"", "attempt": 0, "updated_at": now_ms()})
        pipe.zadd(RUNS_WATCH, {keys.run_id: now_ms() + QUEUED_RECHECK_MS})
        enqueue_next(pipe)
        if event:
            event.stage(pipe)

    _fenced_transaction(r, keys, token, stage)
    if event:
        event.log()


def defer_turn(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    model_errors: int,
    delay_ms: int,
    enqueue_later: Callable[[Pipeline, int], None],
) -> None:
    """Give the turn back after a transient model error: it runs again in ``delay_ms`` through a
    scheduled job; no turn is counted and no worker waits."""

    def stage(pipe: Pipeline, attempt: int) -> None:
        pipe.hset(keys.run, mapping={"model_errors": model_errors, "attempt": attempt + 1, "updated_at": now_ms()})
        pipe.zadd(RUNS_WATCH, {keys.run_id: now_ms() + delay_ms + QUEUED_RECHECK_MS})
        enqueue_later(pipe, attempt + 1)

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
) -> None:
    """Fenced end of a turn without a next one (a limit reached, a failure, a wait for a person),
    with the ``event`` that reports it.

    ``retention_s`` applies only to statuses that are final; ``watch_at_ms`` keeps the run in the
    reaper's watch set until then (an approval that expires)."""
    code = run_script(
        "finish",
        r,
        [keys.run, keys.lease, keys.messages, RUNS_WATCH, STATS, keys.events, keys.ledger, keys.approvals],
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
            *script_args(event),
        ],
    )
    _check(int(code), keys, r)  # type: ignore[arg-type]
    if event:
        event.log()


def _expire(pipe: Pipeline, keys: RunKeys, retention_s: int) -> None:
    if retention_s > 0:
        for key in keys.kept():
            pipe.expire(key, retention_s)


def fail_unfenced(r: Redis, run_id: str, reason: str, *, retention_s: int = 0) -> None:
    """Fail a run without holding its lease (its records are unreadable, or its turn keeps dying),
    touching only its status and error fields."""
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:
        pipe.hset(keys.run, mapping={"status": "failed", "error": safe_text(reason), "updated_at": now_ms()})
        pipe.delete(keys.lease)
        pipe.zrem(RUNS_WATCH, run_id)
        _expire(pipe, keys, retention_s)
        pipe.execute()


def set_status_unfenced(
    r: Redis,
    run_id: str,
    status: str,
    *,
    error: str = "",
    allowed_from: frozenset[str] | None = None,
    retention_s: int = 0,
) -> str:
    """A status change by a person (cancel): not fenced by a lease, checked against the current status.

    Returns the status the run had. A turn in flight notices at its next fenced write.
    """
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.run)
                current = pipe.hget(keys.run, "status")
                if current is None:
                    raise RunNotFound(run_id)
                before = current.decode()
                if before in TERMINAL_STATUSES or (allowed_from is not None and before not in allowed_from):
                    pipe.unwatch()
                    return before
                pipe.multi()
                pipe.hset(keys.run, mapping={"status": status, "error": safe_text(error), "updated_at": now_ms()})
                if status in TERMINAL_STATUSES:
                    pipe.zrem(RUNS_WATCH, run_id)
                    _expire(pipe, keys, retention_s)
                pipe.execute()
                return before
            except WatchError:
                continue


def list_run_ids(r: Redis, limit: int = 100) -> list[str]:
    return [i.decode() for i in r.zrevrange(RUNS, 0, limit - 1)]
