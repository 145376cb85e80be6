"""``agentpool bench --only deferred``: how late deferred turns start while workers die; and
``--only durability``: what the durability guard costs per turn, against a primary and a replica.

Runs back off after 529s from the scripted model (``retry-after: 1``, three deferrals per run); while
they do, the worker that scans this second is SIGKILLed with its horse, then every worker is replaced
one after another (its replacement first, ready, as Kubernetes does). Lateness is a deferred turn's due
time (the ``model_error`` event's ``retry_at``) to the ``turn_started`` event of its retry.
"""

from __future__ import annotations

import statistics
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


TURNS = 10
STORE = [{"tool_calls": [{"name": "bench_store", "input": {"key": "k"}}]}] * (TURNS - 1) + [{"text": "done"}]


def bench_durability(runs: int, rounds: int) -> None:
    """Turns of one forking worker, each with a tool whose effect is not read, at each durability level,
    interleaved in rounds, on a primary with one replica started here (through a proxy, as in the
    failover tests: a local hop)."""
    from agentpool.ops.bench import Lab, table
    from agentpool.store.durability import waitaof_supported
    from agentpool.testing.localpool import scratch_dir
    from agentpool.testing.replicated import ReplicatedRedis

    workdir = scratch_dir("agentpool-bench-ha-")
    servers = ReplicatedRedis(workdir / "redis").start()
    lab = Lab(servers.primary.url, workdir)
    try:
        levels = [
            ("0 acks (a lone Redis)", {"AGENTPOOL_REPLICA_ACKS": "0"}),
            ("WAIT 1 replica", {"AGENTPOOL_REPLICA_ACKS": "1"}),
        ]
        aof = waitaof_supported(lab.r)
        if aof:
            levels.append(("WAITAOF local + WAIT 1", {"AGENTPOOL_REPLICA_ACKS": "1", "AGENTPOOL_WAITAOF": "local"}))
        per_turn: dict[str, list[float]] = {name: [] for name, _ in levels}
        for _ in range(rounds):
            for name, env in levels:
                per_turn[name].append(_ms_per_turn(lab, runs, env))
        base = statistics.median(per_turn[levels[0][0]])
        rows = [
            [
                name,
                str(runs * TURNS * rounds),
                f"{statistics.median(v):.2f}",
                f"{statistics.median(v) / base:.2f}x",
                "measured, no target",
            ]
            for name, v in per_turn.items()
        ]
        notes = ["one forking worker; the guard is one pipeline (INCR probe, WAIT) before each such tool"]
        if not aof:
            notes.append(f"no WAITAOF row: Redis {lab.r.info('server')['redis_version']} has no WAITAOF (7.2+)")
        table(
            "durability: ms per turn (one tool with an effect each) on a primary with one replica",
            ["level", "turns", "ms/turn (median of rounds)", "vs 0 acks", "target"],
            rows,
            tuple(notes),
        )
    finally:
        lab.close()
        servers.stop()


def _ms_per_turn(lab: Lab, runs: int, env: dict[str, str]) -> float:
    from agentpool.client import enqueue_run, get_run
    from agentpool.ops.bench import AGENT, task, until
    from agentpool.store.keys import RUNS_WATCH

    lab.reset({"store": STORE})
    proc, _name = lab.start(**env)
    started = time.perf_counter()
    ids = [enqueue_run(AGENT, task("store", n), connection=lab.r) for n in range(runs)]
    until(lambda: lab.r.zcard(RUNS_WATCH) == 0, 60 + 5 * runs * TURNS, f"{runs} runs", lab)
    elapsed = time.perf_counter() - started
    bad = [i for i in ids if (run := get_run(i, connection=lab.r)).status != "completed" or run.turns != TURNS]
    if bad:
        raise click.ClickException(f"runs did not complete as scripted: {bad[:3]}")
    lab.workers.kill(proc)
    return elapsed * 1000 / (runs * TURNS)
