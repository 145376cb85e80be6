"""``agentpool bench --only shards``: the same runs on one Redis and spread over two shards.

A second redis-server beside the bench's own makes a pool of two shards (``AGENTPOOL_SHARDS``), served
by one ``agentpool worker`` (a worker process per shard, each with the ``--concurrency`` the one-shard
pool's worker has): nothing else changes. The same runs (the bench agent's trivial tool turns) are
enqueued through ``agentpool.Shards`` as an app would; each shard's share of the turns is read from the
run headers it holds, and its Redis CPU (``INFO cpu``: the server's user + system) and commands (``INFO
commandstats``) per turn from that server alone, net of what it costs while the pool idles (the workers'
dequeue waits, the reaper, heartbeats), beside one shard's. This machine's CPUs are the workers' long
before a Redis saturates, so what is measured is what each shard carries, not the pool's total. One
shard and two are measured in turn, in several rounds (``--shard-rounds``): each figure is the median of
its rounds, with their range. Each shard of two takes its turns more slowly than one shard does, and a
Redis that waits longer between requests pays more for waking up at each, so one shard is measured again
at the rate each shard of two had: at one rate, the two compare what a shard does.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis import Redis

from agentpool.ops.bench import AGENT, TURNS_PER_RUN, Lab, cpu_and_calls, spread, table, task, tool_steps, until
from agentpool.ops.bench_redis import done_within

POLL = 0.1  # the bench's own wait: one ZCARD per shard a tenth of a second, counted and taken out
IDLE = 4.0  # seconds of an idle pool measured for its background rate
HASHED_IDS = 10_000  # ids of an app's own placed by hash, for the note on their spread


@dataclass
class Cost:
    """What one Redis did over ``seconds``: CPU seconds and commands (the bench's own taken out)."""

    cpu_s: float
    commands: int
    seconds: float


def _measure(shards: list[Redis], work: Callable[[], object], done: Callable[[], bool]) -> list[Cost]:
    """Each shard's CPU and commands from before ``work()`` until ``done()`` (one ZCARD per shard a poll)."""
    before = [cpu_and_calls(r) for r in shards]
    started = time.perf_counter()
    work()
    polls = 0
    while not done():
        polls += 1
        time.sleep(POLL)
    polls += 1
    seconds = time.perf_counter() - started
    after = [cpu_and_calls(r) for r in shards]
    own = 2 + polls  # the first snapshot's two INFO, and a ZCARD a poll
    return [Cost(a[0] - b[0], a[1] - b[1] - own, seconds) for a, b in zip(after, before)]


def _runs(lab: Lab, shards: list[Redis], connection: object, turns: int) -> list[Cost]:
    from agentpool.client import enqueue_run
    from agentpool.store.keys import RUNS_WATCH

    runs = math.ceil(turns / TURNS_PER_RUN)
    done = done_within(  # ended runs leave the watch set
        120 + 5 * turns,
        f"{runs} runs on {len(shards)} shard(s)",
        lab,
        lambda: all(r.zcard(RUNS_WATCH) == 0 for r in shards),
    )

    def work() -> None:
        for i in range(runs):
            enqueue_run(AGENT, task("shards", i), connection=connection, check_agent=False)

    return _measure(shards, work, done)


def _turns(r: Redis) -> int:
    """The turns the runs on this Redis took, from their headers."""
    from agentpool.store.keys import RUNS, RunKeys

    ids = [raw.decode() for raw in r.zrange(RUNS, 0, -1)]
    with r.pipeline(transaction=False) as pipe:
        for run_id in ids:
            pipe.hget(RunKeys.of(run_id).run, "turns")
        return sum(int(n or 0) for n in pipe.execute())


def _per_turn(cost: Cost, idle: Cost, turns: int) -> tuple[float, float]:
    """Commands and CPU µs per turn, net of the idle pool's background for as long."""
    share = cost.seconds / idle.seconds
    commands = (cost.commands - idle.commands * share) / max(turns, 1)
    cpu_us = (cost.cpu_s - idle.cpu_s * share) * 1e6 / max(turns, 1)
    return commands, cpu_us


def _hash_spread(n: int) -> str:
    from agentpool.runtime.shards import rendezvous

    on_first = sum(1 for i in range(HASHED_IDS) if rendezvous(f"order-{i}", n) == 0)
    return f"{100 * on_first / HASHED_IDS:.1f} % / {100 - 100 * on_first / HASHED_IDS:.1f} %"


@dataclass
class Shard:
    """What one shard carried in one measurement: its turns, their commands and CPU µs each (net of the
    idle pool), and its turns a second."""

    turns: int
    commands: float
    cpu_us: float
    rate: float


def _carried(cost: Cost, idle: Cost, r: Redis) -> Shard:
    turns = _turns(r)
    return Shard(turns, *_per_turn(cost, idle, turns), turns / cost.seconds)


def _scripts(delay: float = 0.0) -> dict[str, list[dict[str, object]]]:
    """The bench agent's turns, each model call waiting ``delay`` seconds."""
    steps = tool_steps(TURNS_PER_RUN)
    return {"shards": [{**step, "delay": delay} for step in steps] if delay else steps}


def _one_shard(lab: Lab, turns: int, worker: tuple[str, ...], rate: float = 0.0, threads: int = 1) -> Shard:
    """The pool as it is without ``AGENTPOOL_SHARDS``. With ``rate``: its turns come at about that rate a
    second. Each of the ``threads`` then takes a turn every ``threads / rate`` seconds, of which the
    model's wait is what the turn's own time leaves; that own time shrinks as the pool slows (the CPUs
    are less busy), so it is read off a first run that waits the whole span, and a second run, the one
    kept, waits the rest."""
    span = threads / rate if rate else 0.0
    lab.reset(_scripts(span))
    lab.start(*worker)
    _runs(lab, [lab.r], lab.r, TURNS_PER_RUN)  # warm: imports, connections, scripts loaded
    (idle,) = _measure([lab.r], lambda: time.sleep(IDLE), lambda: True)
    lab.r.flushdb()
    (cost,) = _runs(lab, [lab.r], lab.r, turns)
    carried = _carried(cost, idle, lab.r)
    if rate:
        own = max(0.0, threads / carried.rate - span)
        lab.model.set_scripts(_scripts(max(0.0, span - own)))
        lab.r.flushdb()
        (cost,) = _runs(lab, [lab.r], lab.r, turns)
        carried = _carried(cost, idle, lab.r)
    return carried


def _two_shards(lab: Lab, other: Redis, url: str, turns: int, worker: tuple[str, ...]) -> list[Shard]:
    """One worker serving two shards (a process per shard, each as in ``_one_shard``), runs spread by the
    API: what each shard carried."""
    from agentpool.runtime.shards import Shards

    lab.reset(_scripts())
    other.flushdb()
    shards = [lab.r, other]
    lab.names += 1
    name = f"bench-{lab.names}"
    lab.workers.start(1, "--name", name, "--log-level", "WARNING", *worker, AGENTPOOL_SHARDS=f"{lab.url} {url}")
    for n, r in enumerate(shards):
        until(lambda r=r, n=n: r.sismember("rq:workers", f"rq:worker:{name}-s{n}"), 60, f"shard {n}'s worker", lab)
    pool = Shards(shards)
    _runs(lab, shards, pool, 2 * TURNS_PER_RUN)
    idle = _measure(shards, lambda: time.sleep(IDLE), lambda: True)
    for r in shards:
        r.flushdb()
    costs = _runs(lab, shards, pool, turns)
    return [_carried(cost, idle_cost, r) for cost, idle_cost, r in zip(costs, idle, shards)]


def bench_shards(lab: Lab, turns: int, threads: int, rounds: int = 1) -> None:
    """The same runs on one shard and on two, in ``rounds`` interleaved rounds (one shard, two, then one
    shard again at the rate each of the two took its turns, in each): each figure is the median of its
    rounds, a ratio taken within each round."""
    from agentpool.testing.localpool import RedisServer

    workdir = lab.workers.logdir / "shard-1"
    workdir.mkdir(exist_ok=True)
    second = RedisServer(workdir).start()
    ones: list[Shard] = []
    twos: list[list[Shard]] = []
    slowed: list[Shard] = []
    try:
        other = Redis.from_url(second.url)
        worker = ("--concurrency", str(threads))
        for _ in range(rounds):
            ones.append(_one_shard(lab, turns, worker))
            twos.append(_two_shards(lab, other, second.url, turns, worker))
            rate = statistics.median(shard.rate for shard in twos[-1])
            slowed.append(_one_shard(lab, turns, worker, rate, threads))
    finally:
        lab.workers.stop()
        second.stop()

    def row(pool: str, shard: str, carried: list[Shard], share: str, vs_one: str, vs_slowed: str) -> list[str]:
        return [
            pool,
            shard,
            f"{statistics.median(c.turns for c in carried):.0f}",
            share,
            "45-55 %" if pool == "two shards" else "",
            f"{statistics.median(c.commands for c in carried):.1f}",
            spread([c.cpu_us for c in carried], ".0f"),
            f"{statistics.median(c.rate for c in carried):.0f}",
            vs_one,
            "<= 1.10x" if pool == "two shards" else "",
            vs_slowed,
        ]

    rows = [
        row("one shard", "0", ones, "100.0 %", "1.00x", ""),
        row("one shard, at each shard's rate", "0", slowed, "100.0 %", "", "1.00x"),
    ]
    for n in range(2):
        shard = [two[n] for two in twos]
        shares = [100 * two[n].turns / max(sum(s.turns for s in two), 1) for two in twos]
        rows.append(
            row(
                "two shards",
                str(n),
                shard,
                spread(shares, ".1f", " %"),
                spread([mine.cpu_us / max(one.cpu_us, 1e-9) for mine, one in zip(shard, ones)], ".2f", "x"),
                spread([mine.cpu_us / max(one.cpu_us, 1e-9) for mine, one in zip(shard, slowed)], ".2f", "x"),
            )
        )
    table(
        f"shards: the same runs on one Redis and on two shards ({turns} turns, {TURNS_PER_RUN} per run, "
        f"threaded worker --concurrency {threads} per shard; {rounds} round{'s' if rounds > 1 else ''})",
        [
            "pool",
            "shard",
            "turns",
            "share",
            "target",
            "commands/turn",
            "CPU µs/turn",
            "turns/s",
            "vs one shard",
            "target",
            "vs one shard at its rate",
        ],
        rows,
        (
            (
                "turns: read from the run headers each shard holds; runs enqueued through agentpool.Shards (new ids "
                "go round the shards in turn)"
            ),
            (
                "commands and CPU: that shard's redis-server alone (INFO commandstats, INFO cpu), net of its idle "
                "pool's background for as long; the bench's own polls taken out"
            ),
            (
                "one shard, at each shard's rate: the one-shard pool again, each model call waiting so that its "
                "turns come as fast as each shard of two took them (the median of the two): a Redis that waits "
                "longer between requests pays more for waking up at each, so at one rate the comparison is of "
                "what a shard does, not of how busy it is"
            ),
            (
                f"{rounds} rounds, interleaved (one shard, two, then one at their rate, in each): each figure is the "
                "median of the rounds, the share's, the CPU's and the ratios' with the lowest and highest round in "
                "brackets; a ratio is taken within each round"
                if rounds > 1
                else "one round: CPU figures can wander by much between runs; --shard-rounds 3 or more gives medians"
            ),
            f"ids an app gives (placed by a hash of the id): {HASHED_IDS:,} ids over two shards {_hash_spread(2)}",
        ),
    )
