"""``agentpool bench --only redis``: what one turn costs Redis, beside a bare RQ job on the same worker.

Redis, not the workers, is what every turn of the pool goes through, so its cost per turn sets the
pool's ceiling. Around a few hundred turns (enqueue to the last turn's end) this reads Redis's own
``INFO commandstats`` (calls and time by command) and ``INFO cpu`` (the server's user + system CPU), and divides
by the turns. The bench's own polling is counted and taken out; the pool's background (idle workers'
dequeue waits, the reaper's scans, heartbeats) is measured alone for a few seconds and shown apart,
since it costs per second, not per turn. Each is measured twice when this bench started the Redis and the
machine has two CPUs or more: Redis sharing every CPU with the pool, and Redis on a CPU of its own
(``_Placement``). A request costs a Redis that waits between requests more than a busy one (it wakes up
for each), so the bare RQ job is measured twice, back to back and at the turns' own rate, and a lone
``PING`` at the turns' rate of requests shows what a round trip costs before any command runs. The same
code's CPU per turn wanders by up to two times between runs on a shared machine, so every row is measured
in several interleaved rounds (``--redis-rounds``) and shown as the median of its rounds, with their range.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from redis import Redis

from agentpool.ops.bench import AGENT, TURNS_PER_RUN, Lab, spread, table, task, tool_steps, until
from agentpool.testing.scripted_model.ratelimit import RateLimits

POLL = 0.1  # the bench's own wait: one ZCARD a tenth of a second, counted and taken out
IDLE = 4.0  # seconds of an idle pool measured for its background rate
PING_SECONDS = 2.0  # how long the lone round trips are sent for
BARE = "bare RQ job (no-op), back to back"
OURS = "agentpool turn"
BARE_PACED = "bare RQ job (no-op), turns' rate"
PING = "round trip alone (PING), same rate"
OURS_LIMITED = "agentpool turn, rate limits learned"
OURS_AT_FORKING_PACE = "agentpool turn, the forking turns' rate"
# The API's rate-limit headers the scripted model sends in the "rate limits learned" rows: far above what
# the bench asks, so no call waits.
LIMITS = RateLimits(rpm=1_000_000, itpm=1_000_000_000, otpm=100_000_000)


@dataclass
class Sample:
    commands: Counter[str]
    usec: Counter[str]  # Redis's own time inside each command (a script's includes the commands it calls)
    cpu_s: float
    seconds: float
    reads: int  # requests Redis read off its sockets (a pipeline's commands arrive in one): round trips

    @property
    def total(self) -> int:
        return sum(self.commands.values())


def redis_stats(r: Redis) -> tuple[Counter[str], Counter[str], float, int]:
    """Calls and µs by command, the server's CPU seconds, and its socket reads (``total_reads_processed``)."""
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for name, stat in r.info("commandstats").items():
        command = name.removeprefix("cmdstat_")
        calls[command], usec[command] = int(stat["calls"]), int(stat["usec"])
    cpu = r.info("cpu")
    reads = int(r.info("stats")["total_reads_processed"])
    return calls, usec, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), reads


def _measure(lab: Lab, work: Callable[[], object], done: Callable[[], bool]) -> Sample:
    """Redis's calls by command and CPU from before ``work()`` until ``done()``, without the bench's own."""
    r = lab.r
    r.config_resetstat()
    calls_before, usec_before, cpu_before, reads_before = redis_stats(r)
    own: Counter[str] = Counter({"info": 3})  # the three INFO of the first _stats
    started = time.perf_counter()
    work()
    while not done():
        own["zcard"] += 1  # done() is one ZCARD or ZCOUNT (see below)
        time.sleep(POLL)
    own["zcard"] += 1
    seconds = time.perf_counter() - started
    calls_after, usec_after, cpu_after, reads_after = redis_stats(r)
    calls = calls_after - calls_before
    # The bench's own reads: its polls, and the two INFO before the one that read the count.
    own_reads = own["zcard"] + 2
    calls.subtract(own)
    calls.pop("config|resetstat", None)
    return Sample(
        +calls, +(usec_after - usec_before), cpu_after - cpu_before, seconds, reads_after - reads_before - own_reads
    )


def _idle(lab: Lab) -> Sample:
    return _measure(lab, lambda: time.sleep(IDLE), lambda: True)


def done_within(seconds: float, what: str, lab: Lab, ended: Callable[[], bool]) -> Callable[[], bool]:
    """``ended`` as ``_measure``'s ``done``, giving up with the workers' logs ``seconds`` from now: a
    worker that never ends the work fails the bench instead of hanging it."""
    deadline = time.monotonic() + seconds

    def done() -> bool:
        if time.monotonic() > deadline:
            until(lambda: False, 0, what, lab)
        return ended()

    return done


Load = tuple[Callable[[], object], Callable[[], bool]]  # the work to start, and whether it is done


def runs_load(lab: Lab, turns: int, via: Redis | None = None) -> Load:
    """Runs of ``TURNS_PER_RUN`` turns enough for ``turns``: enqueued by ``work`` (through ``via``, the lab's
    client unless given), all ended when ``done`` (asked of the lab's client)."""
    from agentpool.client import enqueue_run
    from agentpool.store.keys import RUNS_WATCH

    runs = math.ceil(turns / TURNS_PER_RUN)

    def work() -> None:
        for i in range(runs):
            # As an app enqueues: the agent loaded, so the first turn's call is reserved with its lease too.
            enqueue_run(AGENT, task("redis", i), connection=via or lab.r)

    # Ended runs leave the watch set.
    return work, done_within(120 + 5 * turns, f"{runs} runs", lab, lambda: lab.r.zcard(RUNS_WATCH) == 0)


def _runs(lab: Lab, turns: int) -> Sample:
    return _measure(lab, *runs_load(lab, turns))


def _paced(count: int, rate: float | None, send: Callable[[int], object]) -> None:
    """``send(i)`` for each of ``count``, back to back, or at ``rate`` a second (a request's arrival at the
    rate of the turns measured beside it: how busy Redis is changes what a request costs it)."""
    started = time.perf_counter()
    for i in range(count):
        if rate:
            time.sleep(max(0.0, started + i / rate - time.perf_counter()))
        send(i)


@contextmanager
def limits_learned(lab: Lab) -> Iterator[None]:
    """The scripted model sends the API's rate-limit headers, as the API does, and the pool has learned
    the limits from the first replies: each turn then reserves its call within them and settles it after.
    The limits are far above what the bench asks, so no call waits."""
    lab.model.set_rate_limits(LIMITS)
    try:
        _runs(lab, TURNS_PER_RUN)
        yield
    finally:
        lab.model.set_rate_limits(None)


def _limited_runs(lab: Lab, turns: int) -> Sample:
    """``_runs`` within learned limits (``limits_learned``)."""
    with limits_learned(lab):
        return _runs(lab, turns)


def _runs_at_rate(lab: Lab, turns: int, rate: float, own_seconds: float, threads: int) -> Sample:
    """``_runs`` slowed to ``rate`` turns a second: each model call waits what a turn on one of the
    ``threads`` must take at that rate, less its own ``own_seconds`` (measured unhindered). The forking
    worker's turns arrive at a fraction of the threaded worker's rate, and a Redis that waits longer between
    requests pays more for each: at one rate, the two kinds' CPU per turn compare their work alone."""
    delay = max(0.0, threads / rate - own_seconds)
    lab.model.set_scripts({"redis": [{**step, "delay": delay} for step in tool_steps(TURNS_PER_RUN)]})
    try:
        return _runs(lab, turns)
    finally:
        lab.model.set_scripts({"redis": tool_steps(TURNS_PER_RUN)})


def bare_load(lab: Lab, jobs: int, rate: float | None = None, via: Redis | None = None) -> Load:
    """Bare RQ jobs (a no-op function) enqueued as agentpool enqueues a turn: one pipeline each (through
    ``via``, the lab's client unless given), back to back or at ``rate`` jobs a second."""
    from agentpool.runtime.jobs import turn_queue

    queue = turn_queue(lab.r)
    finished = queue.finished_job_registry.key
    before = lab.r.zcard(finished)

    def enqueue(i: int) -> None:
        with (via or lab.r).pipeline() as pipe:
            pipe.multi()
            queue.enqueue("agentpool.ops.bench.bare_noop", i, pipeline=pipe, description="bench baseline")
            pipe.execute()

    done = done_within(60 + jobs, f"{jobs} bare jobs", lab, lambda: lab.r.zcard(finished) - before >= jobs)
    return lambda: _paced(jobs, rate, enqueue), done


def _bare(lab: Lab, jobs: int, rate: float | None = None) -> Sample:
    return _measure(lab, *bare_load(lab, jobs, rate))


def _pings(lab: Lab, count: int, rate: float) -> Sample:
    """``count`` PINGs at ``rate`` a second: what a round trip alone costs Redis at that pace."""
    return _measure(lab, lambda: _paced(count, rate, lambda _: lab.r.ping()), lambda: True)


def _per_turn(sample: Sample, idle: Sample, n: int) -> tuple[float, float, float, float, float]:
    """Commands and CPU µs per turn, as measured and net of the idle pool's background for as long, and
    round trips per turn net of it."""
    share = sample.seconds / idle.seconds
    commands = sample.total / n
    cpu_us = sample.cpu_s * 1e6 / n
    net_commands = (sample.total - idle.total * share) / n
    net_cpu_us = (sample.cpu_s - idle.cpu_s * share) * 1e6 / n
    net_reads = (sample.reads - idle.reads * share) / n
    return commands, cpu_us, net_commands, net_cpu_us, net_reads


@dataclass
class _Measured:
    """One row of one round: where Redis ran, on which worker, which job; its sample and what it is set against."""

    where: str
    kind: str
    job: str
    sample: Sample
    idle: Sample
    n: int
    baseline_cpu_us: float  # the bare RQ job's net CPU at the turns' rate beside it

    @property
    def key(self) -> tuple[str, str, str]:
        return self.where, self.kind, self.job

    @property
    def figures(self) -> tuple[float, float, float, float, float]:
        return _per_turn(self.sample, self.idle, self.n)

    @property
    def vs_bare(self) -> float:
        return self.figures[3] / max(self.baseline_cpu_us, 1e-9)


def _row(rounds: list[_Measured]) -> list[str]:
    """One row of the table: the median of each figure over the rounds (``rounds``: the same row's
    measurement in each), with the range of the CPU figures, which wander between rounds; the commands and
    round trips do not."""
    first = rounds[0]
    figures = [m.figures for m in rounds]
    commands, cpu_us, net_commands, net_cpu_us, net_reads = ([f[i] for f in figures] for i in range(5))
    ours_threaded = first.job in (OURS, OURS_LIMITED) and "threaded" in first.kind
    rate = statistics.median(m.n / m.sample.seconds for m in rounds)
    at_rate = f" ({rate:.0f}/s)" if first.job == OURS_AT_FORKING_PACE else ""
    return [
        first.where,
        first.kind,
        first.job + at_rate,
        f"{statistics.median(commands):.1f}",
        f"{statistics.median(net_commands):.1f}",
        "<= 40" if ours_threaded else "",
        f"{statistics.median(net_reads):.1f}",
        spread(cpu_us, ".0f"),
        spread(net_cpu_us, ".0f"),
        "<= 250" if ours_threaded else "",
        spread([m.vs_bare for m in rounds], ".2f", "x") if first.job in (OURS, OURS_LIMITED) else "",
        "" if first.job == PING else f"{1e6 / max(statistics.median(net_cpu_us), 1e-9):,.0f}",
    ]


Rows = dict[tuple[str, str, str], list[_Measured]]  # (placement, worker kind, job) -> that row in each round


def _forking_against_threaded(rows: Rows) -> list[str]:
    """Issue 22's forking target, within 1.2x of the threaded turn: per placement of Redis, the forking
    turn over the threaded one, and over the threaded one at the forking turns' rate. Each ratio is taken
    within a round (the rows' lists are in the rounds' order), then their median (and range)."""
    lines = []
    for where in dict.fromkeys(where for where, _, _ in rows):
        turns = {kind.split()[0]: rounds for (at, kind, job), rounds in rows.items() if at == where and job == OURS}
        paced = next(
            (rounds for (at, _, job), rounds in rows.items() if at == where and job == OURS_AT_FORKING_PACE), []
        )
        if "forking" not in turns or "threaded" not in turns:
            continue

        def ratios(against: list[_Measured], forking: list[_Measured] = turns["forking"]) -> str:
            pairs = [(mine.figures, theirs.figures) for mine, theirs in zip(forking, against)]
            commands = [mine[2] / theirs[2] for mine, theirs in pairs]
            cpu = [mine[3] / max(theirs[3], 1e-9) for mine, theirs in pairs]
            return f"commands {statistics.median(commands):.2f}x, CPU {spread(cpu, '.2f', 'x')}"

        line = f"forking turn / threaded turn, Redis {where}: {ratios(turns['threaded'])} (target: within 1.2x)"
        if paced:
            line += f"; against the threaded turn at the forking turns' rate: {ratios(paced)}"
        lines.append(line)
    return lines


def _top(per_command: Counter[str], n: int, k: int = 8) -> str:
    """The ``k`` biggest of ``per_command`` (calls or µs), divided by ``n``."""
    return ", ".join(f"{name.upper()} {value / n:.1f}" for name, value in per_command.most_common(k))


class _Placement:
    """Where Redis runs beside the pool: on the same CPUs as everything else (this machine as it is), or
    on a CPU of its own with the bench, the scripted model and the workers on the others, as a Redis
    server at capacity has one. Sharing, Redis's caches are cold at every request (the workers' Python
    runs between two), which costs it a good part of its CPU per turn: both figures are shown."""

    def __init__(self, lab: Lab) -> None:
        self.everything = sorted(os.sched_getaffinity(0))
        # Only a Redis this bench started can be placed, and only with a CPU left for the pool.
        self.redis_pid = int(lab.r.info("server")["process_id"]) if lab.server else 0
        self.can_isolate = bool(self.redis_pid) and len(self.everything) >= 2
        self.placements = [False, True] if self.can_isolate else [False]

    def set(self, isolated: bool) -> None:
        pool = self.everything[:-1] if isolated else self.everything
        redis_cpus = self.everything[-1:] if isolated else self.everything
        # Every thread of this process (the scripted model's among them): what they start inherits it, and
        # so do the workers started next.
        _pin(os.getpid(), pool)
        if self.redis_pid:
            _pin(self.redis_pid, redis_cpus)


def _pin(pid: int, cpus: list[int]) -> None:
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile (one of the model's request threads)
            pass


def _round(lab: Lab, placement: _Placement, turns: int, threads: int) -> list[_Measured]:
    """One round: every row, under each placement of Redis and on each worker kind."""
    measured: list[_Measured] = []
    forking_rate: dict[str, float] = {}  # placement -> the forking worker's turns a second
    for isolated in placement.placements:
        placement.set(isolated)
        where = f"own CPU ({placement.everything[-1]})" if isolated else "shares all"
        for kind, args in (
            ("forking (--concurrency 1)", ()),
            (f"threaded (--concurrency {threads})", ("--concurrency", str(threads))),
        ):
            lab.reset({"redis": tool_steps(TURNS_PER_RUN)})
            lab.start(*args)
            _runs(lab, TURNS_PER_RUN)  # warm: imports, connections, scripts loaded
            _bare(lab, 5)
            idle = _idle(lab)
            bare = _bare(lab, turns)
            ours = _runs(lab, turns)
            # The same load as the turns': RQ's job at their rate, and a lone round trip at their rate
            # of requests (a Redis that waits between requests pays for every wake-up).
            paced = _bare(lab, turns, rate=turns / ours.seconds)
            pings = max(100, round(ours.reads / ours.seconds * PING_SECONDS))
            ping = _pings(lab, pings, rate=ours.reads / ours.seconds)
            samples = [(BARE, bare, turns), (OURS, ours, turns), (BARE_PACED, paced, turns), (PING, ping, pings)]
            if kind.startswith("forking"):
                forking_rate[where] = turns / ours.seconds
            elif where in forking_rate:  # before the limits are learned: they stay learned
                slowed = _runs_at_rate(lab, turns, forking_rate[where], threads * ours.seconds / turns, threads)
                samples.append((OURS_AT_FORKING_PACE, slowed, turns))
            samples.append((OURS_LIMITED, _limited_runs(lab, turns), turns))
            baseline = _per_turn(paced, idle, turns)[3]
            measured += [_Measured(where, kind, job, sample, idle, n, baseline) for job, sample, n in samples]
    return measured


def _details(rows: Rows) -> list[str]:
    """Each row's biggest commands and their time, and each idle pool's, summed over the rounds."""
    details = []
    for (where, kind, job), rounds in rows.items():
        n = sum(m.n for m in rounds)
        if job != PING:
            commands = sum((m.sample.commands for m in rounds), Counter())
            usec = sum((m.sample.usec for m in rounds), Counter())
            details.append(f"{kind}, Redis {where}, {job}: {_top(commands, n)}")
            details.append(f"{kind}, Redis {where}, {job}, µs inside commands: {_top(usec, n)}")
        if job == OURS:  # one idle pool per worker kind and placement in each round
            idle = [m.idle for m in rounds]
            seconds = sum(i.seconds for i in idle)
            details.append(
                f"{kind}, Redis {where}, idle pool: {sum(i.total for i in idle) / seconds:.1f} commands/s, "
                f"{sum(i.cpu_s for i in idle) * 1e6 / seconds:.0f} µs CPU/s "
                f"({_top(sum((i.commands for i in idle), Counter()), len(idle), 5)} over {seconds / len(idle):.1f} s)"
            )
    return details


def bench_redis(lab: Lab, turns: int, threads: int, rounds: int = 1) -> None:
    """The table of ``rounds`` rounds of every row, interleaved (each round measures every row in turn,
    so a change in the machine's speed hits every row alike): each figure is the median of its rounds."""
    placement = _Placement(lab)
    by_row: Rows = {}
    try:
        for _ in range(rounds):
            for m in _round(lab, placement, turns, threads):
                by_row.setdefault(m.key, []).append(m)
    finally:
        placement.set(False)
        lab.workers.stop()  # started under the last placement
    rows = [_row(row_rounds) for row_rounds in by_row.values()]
    details = [*_forking_against_threaded(by_row), *_details(by_row)]
    if not placement.can_isolate:
        details.insert(
            0, "Redis was not given a CPU of its own: it was not started by this bench, or the machine has one CPU"
        )
    table(
        (
            f"redis: Redis commands and Redis CPU per turn ({turns} turns, {TURNS_PER_RUN} per run; bare RQ: "
            f"{turns} jobs; {rounds} round{'s' if rounds > 1 else ''})"
        ),
        [
            "Redis",
            "worker",
            "job",
            "commands",
            "net of idle",
            "target",
            "round trips",
            "CPU µs",
            "net of idle",
            "target",
            "CPU vs bare RQ",
            "turns/s per Redis core",
        ],
        rows,
        (
            (
                "measured by Redis itself (INFO commandstats, INFO cpu: the server's user + system CPU) from the "
                "first enqueue to the last turn's end; the bench's own polls are taken out"
            ),
            (
                f"{rounds} rounds, interleaved (each round measures every row in turn): each figure is the median "
                "of the rounds, the CPU's with the lowest and highest round in brackets (the same code's CPU "
                "wanders between runs on a shared machine; its commands and round trips do not); a ratio is "
                "taken within each round, then its median"
                if rounds > 1
                else "one round: CPU figures can wander by much between runs; --redis-rounds 3 or more gives medians"
            ),
            "net of idle: less what the idle pool (dequeue waits, reaper, heartbeats) costs per second, for as long",
            (
                "round trips: requests Redis read off its sockets (INFO stats total_reads_processed; a pipeline's "
                "commands arrive in one), net of idle"
            ),
            (
                "back to back: the bare jobs enqueued as fast as the bench can, so Redis is busier than under the "
                "turns; turns' rate: as many jobs a second as the turns measured beside them made, the fair "
                "baseline (a Redis that waits between requests pays for waking up at each one)"
            ),
            (
                "round trip alone: PINGs sent one at a time at the turns' rate of requests, its figures per PING: "
                "what each of a turn's round trips costs Redis before any command runs"
            ),
            (
                "rate limits learned: the scripted model sends the API's rate-limit headers (limits far above the "
                "bench's pace), so each turn reserves its call within the learned limits and settles it after, as "
                "against the API; the rows above have a model that sends none (one read of the budget a turn)"
            ),
            (
                "CPU vs bare RQ: the turn's net CPU over the bare RQ job's at the turns' rate, on the same worker "
                "and placement (measured in this run, beside it)"
            ),
            (
                "the forking turns' rate: the threaded worker's turns slowed to the forking worker's rate (each "
                "model call waits; the rate reached in brackets): a Redis that waits longer between requests pays "
                "more for each, so at one rate the two kinds' CPU per turn compares their own work"
            ),
            (
                "turns/s per Redis core = 1,000,000 / net CPU µs per turn, at this pace: a floor, as a Redis this "
                "far from busy pays a wake-up per request (--only capacity measures a core kept busy)"
            ),
            (
                "Redis: 'shares all': Redis, the workers, the scripted model and the bench on all the machine's "
                "CPUs; 'own CPU': Redis alone on one CPU (sched_setaffinity), everything else on the others, as a "
                "Redis server at capacity has a core of its own (sharing, its caches are cold at every request)"
            ),
            (
                "µs inside commands: Redis's own time in each command per turn (INFO commandstats usec); a "
                "script's (EVALSHA) includes the commands it calls, which are counted under their names too; "
                "the CPU not inside any command goes to reading and writing the sockets"
            ),
            *details,
        ),
    )
