"""``agentpool bench --only limits``: a pool against a scripted model limited per minute, with the
pool's rate limiter on (learned from the headers, nothing configured) and off (today's behaviour: each
turn backs off alone after its 429), side by side; then two tenants sharing the pool (``bench_tenants``)
and webhooks to a receiver that fails and goes down (``bench_webhooks.py``).

The minute is scaled down (``--limit-minute``) with the limits kept (600 requests and 200,000 input
tokens a minute by default), so the ratios are the issue's. Throughput is what the scripted model
admitted over what its buckets could have admitted in that time (full at the start, refilled at the
limit's rate): the binding dimension's share is the figure (target at least 90 %); the 429 share is of
every call the model answered (target at most 1 %).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from agentpool.ops.bench import Lab

LIMITED_AGENT = "agentpool.ops.bench:bench_agent"


def bench_limits(
    lab: Lab, runs: int, turns: int, workers: int, concurrency: int, minute: float, rpm: int, itpm: int
) -> None:
    from agentpool.ops.bench import table, task, tool_steps
    from agentpool.ops.bench_redis import redis_stats
    from agentpool.store import stats
    from agentpool.testing.scripted_model import RateLimits

    rows, most = [], []
    for label, env in (
        ("limiter off (today)", {"AGENTPOOL_RATE_LIMITER": "off"}),
        ("limiter on (learned)", {"AGENTPOOL_RATE_LIMITER": "on"}),
    ):
        lab.reset({"limits": tool_steps(turns)})
        lab.model.set_rate_limits(RateLimits(rpm=rpm, itpm=itpm, minute=minute))
        env = {**env, "AGENTPOOL_RATE_LIMIT_MINUTE": str(minute)}
        for _ in range(workers):
            lab.start("--concurrency", str(concurrency), **env)
        calls_before, _, _, reads_before = redis_stats(lab.r)
        seconds, statuses, polls, polled = _run_all(lab, runs, task)
        calls_after, _, _, reads_after = redis_stats(lab.r)
        lab.workers.stop()  # its counters flushed
        asked = runs * turns
        # Less the bench's own: its polls, and the INFO of the first redis_stats (three commands, two
        # requests besides the one that read the count).
        by_command = calls_after - calls_before
        by_command["hget"] -= polled
        by_command["info"] -= 3
        commands = sum(by_command.values())
        top = ", ".join(f"{name} {n / asked:.1f}" for name, n in by_command.most_common(6))
        most.append(f"{label}: the most commands a turn: {top}")
        requests = reads_after - reads_before - polls - 2
        waits = sum(v for k, v in stats.read_all(lab.r).items() if k.startswith("budget_waits|"))
        totals = lab.model.limiter.totals()
        answered = totals["requests"] + totals["refused"]
        allowed_requests = rpm + rpm * seconds / minute
        allowed_input = itpm + itpm * seconds / minute
        share_requests = totals["requests"] / allowed_requests
        share_input = totals["input-tokens"] / allowed_input
        rows.append(
            [
                label,
                str(asked),
                str(answered),
                f"{waits / asked:.2f}",
                f"{commands / asked:.1f}",
                f"{requests / asked:.1f}",
                f"{100 * totals['refused'] / max(1, answered):.1f} %",
                f"{seconds:.1f}",
                f"{100 * share_requests:.0f} %",
                f"{100 * share_input:.0f} %",
                f"{100 * max(share_requests, share_input):.0f} %",
                str(statuses.count("completed")),
                str(statuses.count("stopped")),
                "baseline" if env["AGENTPOOL_RATE_LIMITER"] == "off" else "429 <= 1 %, throughput >= 90 %",
            ]
        )
    table(
        f"limits: {runs} runs of {turns} turns on {workers} threaded workers at --concurrency {concurrency}, "
        f"against {rpm} requests and {itpm:,} input tokens a minute (a minute of {minute:g} s)",
        [
            "pool",
            "turns asked",
            "calls",
            "budget waits a turn",
            "Redis commands a turn",
            "round trips a turn",
            "429 share",
            "seconds",
            "requests/limit",
            "input tokens/limit",
            "throughput/limit",
            "completed",
            "stopped",
            "target",
        ],
        rows,
        (
            "x/limit: what the model admitted over what its buckets allowed in that time (full at the start)",
            "stopped: runs that met AGENTPOOL_MODEL_RETRIES + 1 model errors in a row",
            "budget waits: turns deferred until the pool's budget could cover their call, a turn asked",
            (
                "Redis commands (a script's own among them) and round trips (requests Redis read) from the first "
                "enqueue to the last run's end, a turn asked: the runs' enqueues and the idle pool's own included"
            ),
            *most,
        ),
    )


def bench_tenants(
    lab: Lab, big: int, small: int, turns: int, workers: int, concurrency: int, cap: int, delay: float
) -> None:
    """The small tenant's runs alone, then enqueued behind the big tenant's (each tenant with
    ``max_concurrency=cap``): how much longer they take beside it (target at most 2x)."""
    from agentpool.client import enqueue_run
    from agentpool.ops.bench import table, task, tool_steps

    steps = [{**step, "delay": delay} for step in tool_steps(turns)]
    rows = []
    alone = 0.0
    for label, big_runs in (("alone", 0), (f"behind {big:,} queued runs of the big tenant", big)):
        lab.reset({"tenants": steps})
        lab.model.set_rate_limits(None)  # the rows above limited it: here only the tenants' caps hold turns back
        for _ in range(workers):
            lab.start("--concurrency", str(concurrency))
        big_ids = [
            enqueue_run(
                LIMITED_AGENT,
                task("tenants", n),
                connection=lab.r,
                concurrency_key="big",
                max_concurrency=cap,
                check_agent=False,
            )
            for n in range(big_runs)
        ]
        started = time.monotonic()
        small_ids = [
            enqueue_run(
                LIMITED_AGENT,
                task("tenants", big_runs + n),
                connection=lab.r,
                concurrency_key="small",
                max_concurrency=cap,
                check_agent=False,
            )
            for n in range(small)
        ]
        statuses = _wait_ended(lab, small_ids, started)
        seconds = time.monotonic() - started
        big_ended = sum(1 for s in _statuses(lab, big_ids) if s in ENDED)
        alone = alone or seconds
        rows.append(
            [
                label,
                f"{seconds:.2f}",
                f"{seconds / alone:.2f}x",
                str(statuses.count("completed")),
                str(big_ended),
                "baseline" if not big_runs else "<= 2x",
            ]
        )
        lab.workers.stop()
    table(
        f"tenants: a small tenant's {small} runs of {turns} turns alone and behind a big tenant's {big:,}, "
        f"max_concurrency {cap} each, on {workers} threaded workers at --concurrency {concurrency}",
        ["small tenant", "seconds", "x alone", "small completed", "big runs ended meanwhile", "target"],
        rows,
        (
            (
                f"each model call takes {delay:g} s; the big tenant's runs are all queued before the small tenant's "
                "first is enqueued (the clock starts then) and go on meanwhile"
            ),
        ),
    )


ENDED = ("completed", "failed", "stopped", "cancelled")


def _statuses(lab: Lab, ids: list[str]) -> list[str]:
    from agentpool.store.keys import RunKeys

    with lab.r.pipeline(transaction=False) as pipe:
        for run_id in ids:
            pipe.hget(RunKeys.of(run_id).run, "status")
        return [(s or b"").decode() for s in pipe.execute()]


def _wait_ended(lab: Lab, ids: list[str], started: float, limit: float = 1800) -> list[str]:
    while True:
        statuses = _statuses(lab, ids)
        if all(s in ENDED for s in statuses):
            return statuses
        if time.monotonic() > started + limit:
            raise click.ClickException(f"{len(ids)} runs did not end; logs:\n{lab.workers.logs(2000)}")
        time.sleep(0.05)


def _run_all(lab: Lab, runs: int, task: object) -> tuple[float, list[str], int, int]:
    """Enqueue ``runs`` runs and wait for them all to end: (seconds, their statuses, the bench's own
    polls of Redis meanwhile, one pipeline each, and the commands among them)."""
    from agentpool.client import enqueue_run

    started = time.monotonic()
    ids = [enqueue_run(LIMITED_AGENT, task("limits", n), connection=lab.r) for n in range(runs)]  # type: ignore[operator]
    pending = list(ids)
    statuses: dict[str, str] = {}
    deadline = started + 1800
    polls = polled = 0
    while pending:
        if time.monotonic() > deadline:
            raise click.ClickException(f"{len(pending)} runs did not end; logs:\n{lab.workers.logs(2000)}")
        polls, polled = polls + 1, polled + len(pending)
        for run_id, status in zip(pending, _statuses(lab, pending), strict=True):
            if status in ENDED:
                statuses[run_id] = status
        pending = [run_id for run_id in pending if run_id not in statuses]
        time.sleep(0.1)
    seconds = time.monotonic() - started
    return seconds, [statuses[i] for i in ids], polls, polled
