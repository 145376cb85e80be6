"""The run index, ``ap:runs`` (run id -> created at, ms): read newest first in pipelined pages, and
swept of the ids of runs that expired after their retention.

A finished run's keys expire (``AGENTPOOL_RETENTION_SECONDS``), but Redis cannot expire a member of a
sorted set: without the sweep the index would keep an entry for every run ever made. The reaper takes
one step of the sweep per scan; the cursor lives in Redis, so whichever worker reaps next goes on
where the last one stopped.

A pass over the index begins at most every ``SWEEP_PASS_EVERY`` seconds (the reaper passes a shorter
retention instead). Runs expire after a retention of hours or days, so an entry that outlives its run
by minutes costs nothing; looking at a small index whole every second cost Redis a few commands and an
``EXISTS`` per run, every second (an idle pool's largest cost after its dequeue waits). An index too
large for one pass in that time is swept without a pause, ``SWEEP_COUNT`` entries a scan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from redis import Redis

from agentpool.store.clock import now_ms
from agentpool.store.keys import RUNS, RUNS_SWEEP, RUNS_SWEEP_PASS, RunKeys
from agentpool.store.scripts import run_script

PAGE = 500  # run headers read per round trip
SWEEP_COUNT = 200  # index entries looked at per sweep step (ZSCAN's COUNT, a hint)
SWEEP_PASS_EVERY = 600.0  # seconds: a pass over the whole index begins at most this often


def iter_headers(
    r: Redis, *, page: int = PAGE, scan: int | None = None, where: Callable[[str, str], bool] | None = None
) -> Iterator[tuple[str, dict[bytes, bytes]]]:
    """Each indexed run's id and raw header, newest first, ``page`` headers per round trip; ``scan``
    caps how many index entries are looked at (None: all). Runs whose header has expired are skipped.
    ``where(status, agent)`` picks runs from those two fields before the whole header is read (it
    holds the result and the pending tool inputs), so a filter reads little of the runs it passes.

    Pages by score, not by rank, so runs created while the caller iterates shift nothing: it neither
    sees a run twice nor skips one (runs created meanwhile are newer than the walk and not seen)."""
    for ids in _pages(r, page, scan):
        if where is not None:
            with r.pipeline(transaction=False) as pipe:
                for run_id in ids:
                    pipe.hmget(RunKeys.of(run_id).run, ["status", "agent"])
                fields = pipe.execute()
            ids = [
                run_id
                for run_id, (status, agent) in zip(ids, fields)
                if status is not None
                and where(status.decode(errors="replace"), (agent or b"").decode(errors="replace"))
            ]
        with r.pipeline(transaction=False) as pipe:
            for run_id in ids:
                pipe.hgetall(RunKeys.of(run_id).run)
            headers = pipe.execute()
        for run_id, header in zip(ids, headers):
            if header:
                yield run_id, header


def _pages(r: Redis, page: int, scan: int | None) -> Iterator[list[str]]:
    upper: float | str = "+inf"
    tied = 0  # entries already seen whose score is ``upper``
    looked = 0
    while scan is None or looked < scan:
        num = page if scan is None else min(page, scan - looked)
        rows = r.zrevrangebyscore(RUNS, upper, "-inf", start=tied, num=num, withscores=True)
        if not rows:
            return
        yield [member.decode() for member, _ in rows]
        looked += len(rows)
        last = rows[-1][1]
        at_last = sum(1 for _, score in rows if score == last)
        tied = tied + at_last if upper == last else at_last
        upper = last
        if len(rows) < num:
            return


def sweep_expired(r: Redis, *, count: int = SWEEP_COUNT, pass_every: float = SWEEP_PASS_EVERY) -> int:
    """One step of the sweep: look at about ``count`` index entries from where the last step stopped
    and drop those whose run is gone; between two passes, nothing until ``pass_every`` seconds after
    the last pass began (one read). Returns how many were dropped."""
    raw_cursor, raw_began = r.mget(RUNS_SWEEP, RUNS_SWEEP_PASS)
    cursor, now = int(raw_cursor or 0), now_ms()
    if cursor == 0:
        if raw_began is not None and now - int(raw_began) < pass_every * 1000:
            return 0
        r.set(RUNS_SWEEP_PASS, now)
    cursor, entries = r.zscan(RUNS, cursor, count=count)
    ids = [member.decode() for member, _ in entries]
    dropped = run_script("index_prune", r, [RUNS, *(RunKeys.of(run_id).run for run_id in ids)], ids) if ids else 0
    r.set(RUNS_SWEEP, cursor)
    return int(dropped)
