"""Deferred turns: recorded in ``ap:turns:deferred`` (run, turn, re-enqueue n -> due time in ms) by the
transaction that defers them (``jobs.stage_turn(..., delay=...)``), and moved onto the RQ queue by the
reaper once due, under the job id the run's header already names. The deferral also leaves in the
header what the turn's job is to carry (``jobs.DEFERRED_META``: where the run's window starts, and the
model call it was about to make), so the turn reads its window and reserves its call with its lease, as
a turn its predecessor queued does, instead of in a script and a round trip of its own.

The move is one WATCH/MULTI transaction over the sorted set: the entries leave it and their jobs are
pushed together, so two reapers racing (a lock that lapsed mid-scan, ``agentpool reap`` beside the
pool) enqueue a turn once, and a reaper that dies half-way leaves the entries for the next scan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import WatchError

from agentpool.runtime.jobs import (
    carried_by_deferrals,
    deferred_member,
    enqueue_turn,
    job_id,
    parse_deferred_member,
)
from agentpool.store.clock import now_ms
from agentpool.store.keys import TURNS_DEFERRED

log = logging.getLogger("agentpool.reaper")
RETRIES = 5  # a defer landing in the set between WATCH and EXEC: read again


@dataclass(frozen=True)
class Promoted:
    run_id: str
    turn: int
    job_id: str
    due_ms: int
    late_ms: int  # when it reached the queue, past its due time


def promote_due(r: Redis, *, batch: int = 500) -> list[Promoted]:
    """Enqueue every deferred turn that is due. Returns what this call moved."""
    # One cheap read first: every worker asks several times a second, and almost always nothing is due.
    if not r.zrangebyscore(TURNS_DEFERRED, "-inf", now_ms(), start=0, num=1):
        return []
    for _ in range(RETRIES):
        with r.pipeline() as pipe:
            try:
                pipe.watch(TURNS_DEFERRED)
                now = now_ms()
                due = pipe.zrangebyscore(TURNS_DEFERRED, "-inf", now, start=0, num=batch, withscores=True)
                if not due:
                    return []
                turns, unreadable = [], []
                for raw, score in due:
                    parsed = parse_deferred_member(raw.decode("utf-8", errors="replace"))
                    if parsed is None:
                        unreadable.append(raw)
                    else:
                        turns.append((*parsed, int(score), raw))
                # Each turn goes back to its run's queue with what its deferral carried: read before MULTI.
                carried = carried_by_deferrals(r, [(run_id, turn, n) for run_id, turn, n, _, _ in turns])
                pipe.multi()
                for raw in unreadable:  # not ours to run: dropped, and said once
                    pipe.zrem(TURNS_DEFERRED, raw)
                    log.error("deferred turns: dropping unreadable entry %r", raw)
                moved = []
                for (run_id, turn, attempt, due_ms, raw), (window, call) in zip(turns, carried, strict=True):
                    pipe.zrem(TURNS_DEFERRED, raw)
                    jid = enqueue_turn(pipe, r, run_id, turn, attempt, window=window, call=call)
                    moved.append(Promoted(run_id, turn, jid, due_ms, max(0, now - due_ms)))
                pipe.execute()
                return moved
            except WatchError:
                continue
    return []


def due_at(r: Redis, run_id: str, turn: int, attempt: int) -> int | None:
    """When the run's deferred turn is due (ms), or None if it is not deferred (any more)."""
    score = r.zscore(TURNS_DEFERRED, deferred_member(run_id, turn, attempt))
    return None if score is None else int(score)


def due_for_job(r: Redis, run_id: str, jid: str) -> int | None:
    """``due_at`` for the job id a run's header names (``<run>-t0007-r3``)."""
    tail = jid[len(run_id) :] if jid.startswith(run_id + "-t") else ""
    turn, _, attempt = tail[2:].partition("-r")
    if not turn.isdigit():
        return None
    n = int(attempt) if attempt.isdigit() else 0
    if job_id(run_id, int(turn), n) != jid:
        return None
    return due_at(r, run_id, int(turn), n)


def summary(r: Redis) -> tuple[int, float]:
    """(deferred turns, seconds the oldest due one is late; 0 if none is due): for metrics and ``runs``."""
    with r.pipeline(transaction=False) as pipe:
        pipe.zcard(TURNS_DEFERRED)
        pipe.zrange(TURNS_DEFERRED, 0, 0, withscores=True)
        count, first = pipe.execute()
    if not first:
        return int(count), 0.0
    return int(count), max(0.0, (now_ms() - int(first[0][1])) / 1000)
