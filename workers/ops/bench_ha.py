"""``agentpool bench --only deferred``: how late deferred turns start while workers die.

Runs back off after 529s from the scripted model (``retry-after: 1``, three deferrals per run); while
they do, the worker that scans this second is SIGKILLed with its horse, then every worker is replaced
one after another (its replacement first, ready, as Kubernetes does). Lateness is a deferred turn's due
time (the ``model_error`` event's ``retry_at``) to the ``turn_started`` event of its retry.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from agentpool.ops.bench import Lab

OVERLOADED = {"status": 529, "type": "overloaded_error", "message": "Overloaded", "retry_after": 1}
BACKOFF: list[dict[str, Any]] = [
    {"error": {**OVERLOADED, "times": 2}, "tool_calls": [{"name": "bench_lookup", "input": {"key": "k"}}]},
    {"error": {**OVERLOADED, "times": 1}, "text": "done"},
]


def bench_deferred(lab: Lab, runs: int, threads: int, workers: int = 3) -> None:
    from agentpool.client import enqueue_run, wait_for_run
    from agentpool.ops.bench import AGENT, table, task, until
    from agentpool.ops.lateness import deferred_lateness, percentile
    from agentpool.store.keys import REAPER_LOCK, TURNS_DEFERRED

    lab.reset({"backoff": BACKOFF})
    # Threaded workers with room for every run: the figure is the scheduling, not a queue of turns.
    args = ("--concurrency", str(max(2, threads)))
    pool = dict(lab.start(*args) for _ in range(workers))  # proc -> name
    by_name = {name: proc for proc, name in pool.items()}
    ids = [enqueue_run(AGENT, task("backoff", n), connection=lab.r) for n in range(runs)]
    until(lambda: lab.r.zcard(TURNS_DEFERRED) >= min(3, runs), 60, "a deferred turn", lab)
    deadline = time.monotonic() + 30
    while (holder := (lab.r.get(REAPER_LOCK) or b"").decode()) not in by_name:
        if time.monotonic() > deadline:
            raise click.ClickException("no worker took the reaper lock")
        time.sleep(0.005)
    lab.workers.kill(by_name.pop(holder))  # the scanning worker, with its horse: SIGKILL
    lab.start(*args)
    for proc in list(by_name.values()):  # every other worker replaced, one after another
        lab.start(*args)
        lab.workers.kill(proc)
        time.sleep(0.5)
    statuses = [wait_for_run(i, timeout=120, connection=lab.r).status for i in ids]
    if statuses.count("completed") != runs:
        raise click.ClickException(f"runs did not complete: {statuses}; logs:\n{lab.workers.logs(2000)}")
    lateness = [late for i in ids for late in deferred_lateness(lab.r, i)]
    table(
        "deferred turns: due time -> turn started, while the scanning worker is SIGKILLed and every worker replaced",
        ["runs", "deferred turns", "p50 s", "p95 s", "max s", "target"],
        [
            [
                str(runs),
                str(len(lateness)),
                f"{percentile(lateness, 50):.3f}",
                f"{percentile(lateness, 95):.3f}",
                f"{max(lateness):.3f}",
                "p95 <= 2 s",
            ]
        ],
        (
            (
                f"{workers} threaded workers (--concurrency {max(2, threads)}); a kill takes the supervisor and its "
                "worker; no RQ scheduler anywhere: the reaper in every worker enqueues due turns; the lateness "
                "includes the wait for a free worker"
            ),
        ),
    )
