"""``agentpool bench``: what agentpool costs and how fast it recovers, measured on this machine.

Every figure is measured in one invocation against its own redis-server (or an empty database given
with ``--url``), its own scripted model server and real ``agentpool worker`` processes, with the
baseline run beside it on the same worker class. It prints figures with their targets and judges
nothing. Sections: ``overhead``, ``saves``, ``memory``, ``recovery``, ``deferred``, ``durability``, ``long``, ``limits``,
``redis``, ``instructions``, ``shards`` (``--only``; default all; the long-run figures and streaming's share of the overhead are in
``bench_long.py``, the deferred turns' lateness under kills in ``bench_ha.py``, the rate limiter's
429 share and throughput against the limit and two tenants sharing the pool in ``bench_limits.py``,
webhooks to a failing receiver in ``bench_webhooks.py``, Redis's commands and CPU per turn in
``bench_redis.py``, ``instructions``: the same counted in Redis's instructions by callgrind in
``bench_instructions.py``, ``shards``: the same runs on one Redis and on two shards in ``bench_shards.py``).
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from redis import Redis
from redis.utils import HIREDIS_AVAILABLE

from agentpool.agent import Agent
from agentpool.context import current_call
from agentpool.runtime import connections
from agentpool.tools import tool

SECTIONS = (
    "overhead",
    "saves",
    "memory",
    "footprint",
    "recovery",
    "deferred",
    "durability",
    "long",
    "limits",
    "redis",
    "instructions",
    "capacity",
    "shards",
    "versus",
)
AGENT = "agentpool.ops.bench:bench_agent"
MODEL = "claude-sonnet-5-5"
GB = 1e9  # figures per GB use 10^9 bytes
KEEP_RESULTS = 3600  # a baseline job's result outlives the measurement: the finished registry counts them


@tool(effect="read")
def bench_lookup(key: str) -> str:
    """Look a key up: the trivial tool of the overhead figures."""
    return f"{key}: ok"


@tool(effect="read")
def bench_wait(seconds: float) -> str:
    """Wait, on a tool call's first attempt only: slow enough to be killed in, quick when re-run."""
    call = current_call()
    if call is None or call.attempt <= 1:
        time.sleep(seconds)
    return "waited"


@tool(effect="idempotent")
def bench_store(key: str, *, idempotency_key: str) -> str:
    """Store a key somewhere: a tool with an effect, so the durability guard runs before it."""
    return f"{key}: stored under {idempotency_key[-6:]}"


bench_agent = Agent(
    model=MODEL,
    system="You are a benchmark.",
    tools=[bench_lookup, bench_wait, bench_store],
    max_turns=40,
    max_tokens=256,
)


def bare_noop(n: int) -> int:
    """Baseline job: nothing at all."""
    return n


def bare_model_call(n: int) -> int:
    """Baseline job: the model call and the tool call of a turn, without any of agentpool's saves.
    Job ``n`` sends the conversation a run of the overhead section has at its turn ``n % 10``, so
    both sides of the ratio send the model the same bytes."""
    from agentpool.runtime.model import call_model

    call_model(bench_agent, conversation_at(n % TURNS_PER_RUN, f"overhead baseline {n} [script:overhead]"))
    bench_lookup.fn(key="k")
    return n


def conversation_at(turn: int, task_text: str) -> list[dict[str, Any]]:
    """The messages of a run of ``tool_steps`` before its ``turn``: the task, then a tool_use of
    bench_lookup and its result per turn."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task_text}]
    for i in range(turn):
        call = {"type": "tool_use", "id": f"toolu_{i:022d}", "name": "bench_lookup", "input": {"key": "k"}}
        messages += [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "k: ok"}]},
        ]
    return messages


# -- the pool under test -----------------------------------------------------------------------


class Lab:
    """A redis-server, the scripted model and worker processes, torn down together."""

    def __init__(self, url: str | None, workdir: Path) -> None:
        from agentpool.testing import scripted_model
        from agentpool.testing.localpool import RedisServer, WorkerProcesses

        self.server = None if url else RedisServer(workdir).start()
        self.url = url or self.server.url  # type: ignore[union-attr]
        self.r = connections.build(self.url, retry=connections.ride_out())
        if url and self.r.dbsize():
            raise click.ClickException(f"{url} is not empty: bench flushes the database it uses; give an empty one")
        self.model = scripted_model.ScriptedModel(cache_min_tokens=1024).start()
        root = str(Path(__file__).resolve().parent.parent)
        env = {
            **os.environ,
            "REDIS_URL": self.url,
            "ANTHROPIC_BASE_URL": self.model.base_url,
            "ANTHROPIC_API_KEY": "sk-bench-not-a-secret",
            "PYTHONPATH": root,
        }
        env.pop("AGENTPOOL_FAULTS", None)
        env.pop("AGENTPOOL_SHARDS", None)  # the workers serve the bench's Redis, never a pool's shards
        self.workers = WorkerProcesses(env, workdir)
        self.names = 0

    def reset(self, scripts: dict[str, list[dict[str, Any]]]) -> None:
        self.workers.stop()
        # A SIGKILLed worker may still be blocked in BLMOVE inside Redis for a moment: a job pushed then
        # is handed to the dead client, and only the reaper's 30 s recheck would find it again.
        deadline = time.monotonic() + 10
        while self.r.info("clients")["blocked_clients"] and time.monotonic() < deadline:
            time.sleep(0.05)
        self.r.flushdb()
        self.model.reset()
        self.model.set_scripts(scripts)

    def start(self, *args: str, **env: str) -> tuple[subprocess.Popen[bytes], str]:
        """One ``agentpool worker``, once it listens."""
        self.names += 1
        name = f"bench-{self.names}"
        proc = self.workers.start(1, "--name", name, "--log-level", "WARNING", *args, **env)[0]
        until(lambda: self.r.sismember("rq:workers", f"rq:worker:{name}"), 60, f"worker {name} to start", self)
        return proc, name

    def close(self) -> None:
        self.workers.stop()
        self.model.stop()
        if self.server:
            self.server.stop()


def until(predicate: Callable[[], Any], timeout: float, what: str, lab: Lab, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise click.ClickException(f"timed out waiting for {what}; worker logs:\n{lab.workers.logs(2000)}")
        time.sleep(poll)


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def table(title: str, header: list[str], rows: list[list[str]], notes: tuple[str, ...] = ()) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    click.echo(f"\n{title}")
    for row in [header, *rows]:
        click.echo("  " + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
    for note in notes:
        click.echo(f"  note: {note}")


def cpu_and_calls(r: Redis) -> tuple[float, int]:
    """Redis's own CPU seconds so far (``INFO cpu``: user + system) and the commands it has run (``INFO
    commandstats``, a script's own calls among them)."""
    cpu = r.info("cpu")
    calls = sum(int(stat["calls"]) for stat in r.info("commandstats").values())
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), calls


def spread(values: list[float], fmt: str, unit: str = "") -> str:
    """The median of a figure's rounds, and their range in brackets when there were several rounds."""
    lowest, mid, highest = (format(v, fmt) + unit for v in (min(values), statistics.median(values), max(values)))
    return mid if len(values) == 1 else f"{mid} ({lowest}-{highest})"


def task(script: str, n: int) -> str:
    return f"bench task {n} [script:{script}]"


def tool_steps(turns: int, final: str = "done") -> list[dict[str, Any]]:
    return [{"tool_calls": [{"name": "bench_lookup", "input": {"key": "k"}}]}] * (turns - 1) + [{"text": final}]


# -- overhead ----------------------------------------------------------------------------------

TURNS_PER_RUN = 10


def bench_overhead(lab: Lab, turns: int, threaded_turns: int, threads: int, rounds: int) -> None:
    rows = []
    for kind, args, n in (
        ("forking (--concurrency 1)", (), turns),
        (f"threaded (--concurrency {threads})", ("--concurrency", str(threads)), threaded_turns),
    ):
        lab.reset({"overhead": tool_steps(TURNS_PER_RUN)})
        lab.start(*args)
        _agentpool_rate(lab, TURNS_PER_RUN)  # warm: the client, its connections, the imports
        _bare_rate(lab, "agentpool.ops.bench.bare_model_call", 3)
        jobs: dict[str, Callable[[], float]] = {
            "bare RQ job: no-op": lambda n=n: _bare_rate(lab, "agentpool.ops.bench.bare_noop", n),
            "bare RQ job: model call + tool": lambda n=n: _bare_rate(lab, "agentpool.ops.bench.bare_model_call", n),
            "agentpool turn": lambda n=n: _agentpool_rate(lab, n),
        }
        rates: dict[str, list[float]] = {job: [] for job in jobs}
        for _ in range(rounds):  # interleaved, so a change in the machine's load hits every kind alike
            for job, measure in jobs.items():
                rates[job].append(measure())
        mid = {job: statistics.median(r) for job, r in rates.items()}
        for job, r in rates.items():
            ours = job == "agentpool turn"
            ratio = (
                f"{mid['bare RQ job: model call + tool'] / mid[job]:.2f}x (vs no-op "
                f"{mid['bare RQ job: no-op'] / mid[job]:.2f}x)"
                if ours
                else ""
            )
            rows.append(
                [
                    kind,
                    job,
                    f"{mid[job]:.1f}",
                    f"{min(r):.1f}-{max(r):.1f}",
                    f"{1000 / mid[job]:.2f}",
                    ratio,
                    "<= 1.5x" if ours else "",
                ]
            )
    table(
        "overhead: agentpool turn vs bare RQ job, same worker class, one worker process",
        ["worker", "job", "jobs/s", "range", "ms/job", "agentpool cost vs model-call baseline", "target"],
        rows,
        (
            (
                f"{turns} jobs per measurement (threaded: {threaded_turns}), {rounds} rounds interleaved; jobs/s is "
                "the median round, range the slowest and fastest; ms/job = 1000 / jobs/s (the process's throughput, "
                "not a latency)"
            ),
            (
                "a turn = one call to a zero-latency scripted model + a trivial read tool; the model-call baseline "
                "makes the same HTTP call (same client, same conversation as the turn it stands for) and tool call "
                "with none of agentpool's bookkeeping"
            ),
            f"redis-py reply parser: {'hiredis' if HIREDIS_AVAILABLE else 'pure Python (pip install hiredis)'}",
        ),
    )


def _bare_rate(lab: Lab, func: str, n: int) -> float:
    from agentpool.runtime.jobs import turn_queue

    queue = turn_queue(lab.r)
    failed = queue.failed_job_registry

    def done() -> int:  # baseline jobs only: a turn job's result lives 60 s, a baseline job's an hour
        return lab.r.zcount(queue.finished_job_registry.key, time.time() + KEEP_RESULTS / 2, "+inf")

    before = done()
    started = time.perf_counter()
    with lab.r.pipeline() as pipe:
        pipe.multi()
        for i in range(n):
            queue.enqueue(func, i, pipeline=pipe, result_ttl=KEEP_RESULTS, description="bench baseline")
        pipe.execute()
    until(lambda: done() - before >= n or failed.count, 60 + 5 * n, f"{n} {func} jobs", lab)
    if failed.count:
        raise click.ClickException(f"{func} jobs failed; worker logs:\n{lab.workers.logs(2000)}")
    return n / (time.perf_counter() - started)


def _agentpool_rate(lab: Lab, turns: int) -> float:
    from agentpool.client import enqueue_run, get_run
    from agentpool.store.keys import RUNS_WATCH

    runs = math.ceil(turns / TURNS_PER_RUN)
    started = time.perf_counter()
    ids = [enqueue_run(AGENT, task("overhead", i), connection=lab.r) for i in range(runs)]
    until(lambda: lab.r.zcard(RUNS_WATCH) == 0, 60 + 5 * turns, f"{runs} runs", lab)  # ended runs leave the watch set
    elapsed = time.perf_counter() - started
    bad = [
        (run.id, run.status, run.error)
        for run in (get_run(i, connection=lab.r) for i in ids)
        if run.status != "completed" or run.turns != TURNS_PER_RUN
    ]
    if bad:
        raise click.ClickException(f"runs did not complete as scripted: {bad[:3]}")
    return runs * TURNS_PER_RUN / elapsed


# -- saves -------------------------------------------------------------------------------------

RESULT_BYTES = 10_000


def bench_saves(lab: Lab, turns: int, runs: int) -> None:
    """Drives the store calls of a turn directly (no worker, no model) and times each at the first and
    at the last turn of ``runs`` runs; bytes are what the call sent Redis (for the load: read back)."""
    from agentpool.client import new_run_id
    from agentpool.store import checkpoint

    lab.reset({})
    ids = [new_run_id() for _ in range(runs)]
    with lab.r.pipeline() as pipe:
        pipe.multi()
        for n, run_id in enumerate(ids):
            checkpoint.stage_create(pipe, run_id, agent=AGENT, task=task("saves", n), limits={}, now=time.time())
        pipe.execute()
    measured: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for turn in range(turns):
        watch = turn in (0, turns - 1)
        for run_id in ids:
            for name, step in _store_calls_of_a_turn(lab.r, run_id, turn):
                if watch:
                    measured.setdefault((name, turn), []).append(_timed_with_bytes(lab.r, step))
                else:
                    step()
    names = list(dict.fromkeys(n for n, _ in measured))
    for turn in (0, turns - 1):  # every write of a turn together, run by run (the load is a read)
        per_run = zip(*(measured[(n, turn)] for n in names if not n.startswith("load")))
        measured[("all writes of the turn", turn)] = [(sum(s for s, _ in w), sum(b for _, b in w)) for w in per_run]
    rows = []
    for name in dict.fromkeys(n for n, _ in measured):
        first, last = measured[(name, 0)], measured[(name, turns - 1)]
        row = [name]
        for samples in (first, last):
            ms = [s * 1000 for s, _ in samples]
            row += [f"{pct(ms, 50):.3f}", f"{pct(ms, 95):.3f}", f"{statistics.median(b for _, b in samples):,.0f}"]
        bytes_ratio = statistics.median(b for _, b in last) / statistics.median(b for _, b in first)
        is_save = name.startswith("save")
        row += [f"{bytes_ratio:.2f}x", "p50 <= 2 ms, <= 1.2x" if is_save else "-"]
        rows.append(row)
    table(
        f"saves: one run's store calls at turn 1 and at turn {turns} ({runs} runs, 10 KB tool result each turn)",
        [
            "store call",
            "t1 p50 ms",
            "t1 p95 ms",
            "t1 bytes",
            f"t{turns} p50 ms",
            f"t{turns} p95 ms",
            f"t{turns} bytes",
            "bytes ratio",
            "target",
        ],
        rows,
        (
            "bytes = what the call sent to Redis (INFO total_net_input_bytes; for the load: bytes read back)",
            (
                "the load is not a save: it reads the window (the whole conversation of a run never compacted; see "
                "the long section), which the model call sends"
            ),
        ),
    )


def _store_calls_of_a_turn(r: Redis, run_id: str, turn: int) -> list[tuple[str, Callable[[], Any]]]:
    """What a turn of one tool call with a 10 KB result asks of the store, in order, with the progress
    events each write records, as in agentpool.runtime.turn (the lease is taken untimed; its round trip also
    carries the load)."""
    from agentpool.runtime.jobs import stage_turn
    from agentpool.store import checkpoint, lease, ledger, window
    from agentpool.store.events import Event
    from agentpool.store.keys import RunKeys

    keys = RunKeys.of(run_id)
    token = lease.acquire(
        r, keys, turn=turn, worker_id="bench.0", ttl_ms=15_000, event=Event.of(run_id, "turn_started", turn=turn)
    ).token
    call: dict[str, Any] = {"id": f"toolu_{turn:05d}", "name": "bench_lookup", "input": {"key": "k"}}
    message = {"role": "assistant", "content": [{"type": "text", "text": "Looking."}, {"type": "tool_use", **call}]}
    outcome = ledger.Outcome("x" * RESULT_BYTES, False)
    results = {"role": "user", "content": [outcome.as_tool_result(call["id"])]}
    usage = {"input_tokens": 1000 + turn, "output_tokens": 20}
    tool = {"tool": call["name"], "tool_use_id": call["id"], "effect": "read"}

    def event(kind: str, **fields: Any) -> Event:
        return Event.of(run_id, kind, **fields)

    return [
        ("load (read with the lease, before the model call)", lambda: window.load(r, run_id)),
        (
            "save point A (spend, response, pending)",
            lambda: checkpoint.commit_response(
                r,
                keys,
                token,
                turns_before=turn,
                message=message,
                meta={"id": "msg_bench"},
                pending=[call],
                usage=usage,
                cost_usd=0.003,
                ancestors=[],  # a top-level run, as its turn knows from the header it loaded
                responded=event(
                    "model_responded", turn=turn, stop_reason="tool_use", seconds=0.5, cost_usd=0.003, **usage
                ),
                event=event("response_committed", turn=turn, tool_uses=1),
            ),
        ),
        (
            "ledger intent",
            lambda: ledger.write_intent(
                r,
                keys,
                token,
                call,
                effect="read",
                attempt=1,
                now=time.time(),
                event=event("tool_started", **tool),
                at=(turn + 1, "tools"),
            ),
        ),
        (
            "ledger outcome (10 KB)",
            lambda: ledger.write_outcome(
                r,
                keys,
                token,
                call["id"],
                outcome,
                how="ran",
                now=time.time(),
                event=event("tool_finished", **tool, is_error=False),
                at=(turn + 1, "tools"),
            ),
        ),
        (
            "save point B (10 KB results, next job)",
            lambda: checkpoint.commit_tool_results(
                r,
                keys,
                token,
                message=results,
                enqueue_next=lambda pipe: _discard(stage_turn(pipe, r, run_id, turn + 1)),
                turns=turn + 1,
                event=event("turn_committed", turn=turn, next_turn=turn + 1, tool_results=1, seconds=0.6),
            ),
        ),
    ]


def _discard(_value: object) -> None:
    pass


def _timed_with_bytes(r: Redis, step: Callable[[], Any]) -> tuple[float, int]:
    """Seconds the call took and the bytes it moved: sent to Redis, or for a read, received from it.
    Two INFO calls with nothing between them calibrate out the INFO calls' own bytes."""

    def counters() -> tuple[int, int]:
        stats = r.info("stats")
        return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])

    a = counters()
    b = counters()
    started = time.perf_counter()
    step()
    seconds = time.perf_counter() - started
    c = counters()
    sent = (c[0] - b[0]) - (b[0] - a[0])
    received = (c[1] - b[1]) - (b[1] - a[1])
    return seconds, max(sent, received)


# -- memory ------------------------------------------------------------------------------------


def bench_memory(lab: Lab, high: int, hold: float) -> None:
    rows = []
    for kind, args, in_flight in (
        ("forking (--concurrency 1)", (), 1),
        (f"threaded (--concurrency {high})", ("--concurrency", str(high)), high),
    ):
        lab.reset({"hold": [{"delay": hold, "text": "held"}], "warm": [{"text": "warm"}]})
        proc, _name = lab.start(*args)
        _agentpool_run_and_wait(lab, "warm")
        idle = _tree_memory(proc.pid)
        peak = _peak_while_in_flight(lab, proc.pid, in_flight, hold)
        count, rss, pss = peak
        rows.append(
            [
                kind,
                str(count),
                f"{idle[0] / 1e6:.0f}",
                f"{rss / 1e6:.0f}",
                f"{count / (rss / GB):.0f}",
                f"{pss / 1e6:.0f}",
                f"{count / (pss / GB):.0f}",
                ">= 500 (high concurrency)",
            ]
        )
    table(
        f"memory: turns in flight per GB of worker memory (model answers after {hold:g} s)",
        ["worker", "in flight", "idle RSS MB", "RSS MB", "per GB RSS", "PSS MB", "per GB PSS", "target"],
        rows,
        (
            (
                "RSS and PSS summed over the worker's processes (forking: worker + work horse; threaded: supervisor "
                "+ worker process), VmRSS from /proc/<pid>/status, Pss from smaps_rollup, at the peak of turns in "
                "flight; the RSS sum counts pages a fork shares twice, PSS splits them"
            ),
        ),
    )


def _agentpool_run_and_wait(lab: Lab, script: str, n: int = 0) -> None:
    from agentpool.client import enqueue_run, wait_for_run

    run = wait_for_run(enqueue_run(AGENT, task(script, n), connection=lab.r), timeout=120, connection=lab.r)
    if run.status != "completed":
        raise click.ClickException(f"warm-up run {run.status}: {run.error}")


def _peak_while_in_flight(lab: Lab, pid: int, runs: int, hold: float) -> tuple[int, int, int]:
    from agentpool.client import enqueue_run

    for n in range(runs):
        enqueue_run(AGENT, task("hold", n), connection=lab.r)
    best = (0, 0, 0)
    deadline = time.monotonic() + hold + 30
    while time.monotonic() < deadline:
        held = len(lab.r.keys("ap:{run:*}:lease"))
        if held >= best[0]:
            rss, pss = _tree_memory(pid)
            best = max(best, (held, rss, pss))
        if best[0] >= runs or (best[0] and held == 0):
            break
        time.sleep(0.05)
    return best


def _tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes of ``pid`` and its descendants."""
    from agentpool.testing.localpool import children_of

    rss = pss = 0
    pending = [pid]
    while pending:
        p = pending.pop()
        pending += children_of(p)
        try:
            rss += _kb(Path(f"/proc/{p}/status").read_text(), "VmRSS:") * 1024
            pss += _kb(Path(f"/proc/{p}/smaps_rollup").read_text(), "Pss:") * 1024
        except OSError:
            continue
    return rss, pss


def _kb(text: str, field: str) -> int:
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith(field)), 0)


# -- recovery ----------------------------------------------------------------------------------

SLOW_TOOL: list[dict[str, Any]] = [
    {"tool_calls": [{"name": "bench_wait", "input": {"seconds": 120}}]},
    {"text": "resumed"},
]
RESUMED = ("resumed", "turn_started")


def bench_recovery(lab: Lab, trials: int, lease_ttl: float, short_ttl: float, threads: int) -> None:
    rows = []
    for kind, args, target in (
        ("work horse killed (forking worker lives)", (), "p95 <= 1 s"),
        (
            "threaded worker process killed (supervisor lives)",
            ("--concurrency", str(threads)),
            "p95 <= 1 s (as a horse)",
        ),
    ):
        lab.reset({"slow": SLOW_TOOL})
        proc, _name = lab.start(*args)
        times = [_kill_one_process(lab, proc.pid, n) for n in range(trials)]
        rows.append([kind, "-", str(len(times)), f"{pct(times, 50):.3f}", f"{pct(times, 95):.3f}", target])
    for ttl in [lease_ttl] + ([short_ttl] if short_ttl else []):
        times = _kill_whole_workers(lab, trials, ttl)
        label = "whole worker killed (worker + horse)" + ("" if ttl == lease_ttl else ", short TTL")
        rows.append(
            [
                label,
                f"{ttl:g}",
                str(len(times)),
                f"{pct(times, 50):.3f}",
                f"{pct(times, 95):.3f}",
                f"p95 <= {ttl + 3:g} s",
            ]
        )
    table(
        "recovery: SIGKILL while a turn runs a slow tool -> that run's next turn_started/resumed event",
        ["crash", "lease TTL s", "trials", "p50 s", "p95 s", "target"],
        rows,
        (
            (
                "one worker for the first two rows (the same one resumes the turn); for a whole-worker kill, the "
                "killed forking workers' runs are taken over by one live threaded worker through its reaper "
                "(every 1 s); a lease lapses between 2/3 and all of its TTL after the kill (renewed every TTL/3)"
            ),
        ),
    )


BACKLOG_STEP: list[dict[str, Any]] = [{"delay": 0.5, "text": "queued work done"}]  # 0.5 s of a worker each


def bench_recovery_under_load(lab: Lab, trials: int, backlog: int, ttl: float) -> None:
    """A crashed run's takeover time beside its crash-to-continue time, with ``backlog`` turns queued
    behind it: the re-enqueued turn goes to the front of the queue, so the two differ by a turn's
    pick-up, not by the backlog's length (``backlog`` x 0.5 s)."""
    rows = []
    for whole in (False, True):
        takeovers: list[float] = []
        continues: list[float] = []
        for n in range(trials):
            took, went_on = _kill_under_backlog(lab, n, backlog, ttl, whole=whole)
            takeovers.append(took)
            continues.append(went_on)
        label = "whole worker killed (reaper takes over)" if whole else "work horse killed"
        rows.append(
            [
                label,
                str(backlog),
                str(trials),
                f"{pct(takeovers, 50):.3f}",
                f"{pct(takeovers, 95):.3f}",
                f"{pct(continues, 50):.3f}",
                f"{pct(continues, 95):.3f}",
                f"{pct([c - t for c, t in zip(continues, takeovers)], 95):.3f}",
                "gap p95 <= 2 s",
            ]
        )
    table(
        f"recovery under load: SIGKILL mid-tool with {backlog} turns (0.5 s each) queued behind -> takeover, "
        "and -> the run's next turn (crash-to-continue)",
        ["crash", "backlog", "trials", "takeover p50 s", "p95 s", "continue p50 s", "p95 s", "gap p95 s", "target"],
        rows,
        (
            (
                f"lease TTL {ttl:g} s; the backlog would add up to {backlog * 0.5:g} s if the taken-over turn "
                "queued behind it; a whole-worker kill is taken over by the reaper of one live forking worker "
                "that works through the backlog meanwhile"
            ),
        ),
    )


def _kill_under_backlog(lab: Lab, n: int, backlog: int, ttl: float, *, whole: bool) -> tuple[float, float]:
    from agentpool.client import enqueue_run, wait_for_run
    from agentpool.testing.localpool import horses_of

    lab.reset({"slow": SLOW_TOOL, "work": BACKLOG_STEP})
    env = {"AGENTPOOL_LEASE_TTL": f"{ttl:g}"}
    victim, _name = lab.start(**env)
    run_id = enqueue_run(AGENT, task("slow", n), connection=lab.r)
    started = _wait_events(lab, [run_id], ("tool_started",))[run_id][0]
    if whole:
        lab.start(**env)  # the survivor: it works through the backlog, its reaper takes the run over
    queued = [enqueue_run(AGENT, task("work", i), connection=lab.r) for i in range(backlog)]
    if whole:
        lab.workers.kill(victim)  # the worker and its horse
    else:
        os.kill(horses_of(victim.pid)[0], signal.SIGKILL)
    killed = time.monotonic()
    taken = _wait_events(lab, [run_id], ("takeover",), after=started, timeout=ttl + 60)[run_id]
    resumed = _wait_events(lab, [run_id], RESUMED, after=taken[0], timeout=backlog + 60)[run_id][1]
    for rid in [run_id, *queued]:
        if wait_for_run(rid, timeout=backlog + 60, connection=lab.r).status != "completed":
            raise click.ClickException(f"run {rid} did not complete after the kill")
    return taken[1] - killed, resumed - killed


def _kill_one_process(lab: Lab, worker_pid: int, n: int) -> float:
    """The process running the run's turn (the horse, or the threaded worker) is SIGKILLed mid-tool."""
    from agentpool.client import enqueue_run, wait_for_run
    from agentpool.testing.localpool import horses_of

    run_id = enqueue_run(AGENT, task("slow", n), connection=lab.r)
    last = _wait_events(lab, [run_id], ("tool_started",))[run_id][0]
    victims = horses_of(worker_pid)
    if len(victims) != 1:
        raise click.ClickException(f"expected one child of worker {worker_pid}, found {victims}")
    os.kill(victims[0], signal.SIGKILL)
    killed = time.monotonic()
    resumed = _wait_events(lab, [run_id], RESUMED, after=last)[run_id][1]
    if wait_for_run(run_id, timeout=60, connection=lab.r).status != "completed":
        raise click.ClickException(f"run {run_id} did not complete after the kill")
    return resumed - killed


def _kill_whole_workers(lab: Lab, trials: int, ttl: float) -> list[float]:
    """Rounds of up to 10 forking workers, each mid-tool in its own run, all SIGKILLed with their horses."""
    from agentpool.client import enqueue_run

    times: list[float] = []
    while len(times) < trials:
        lab.reset({"slow": SLOW_TOOL})
        size = min(10, trials - len(times))
        env = {"AGENTPOOL_LEASE_TTL": f"{ttl:g}"}
        victims = [lab.start(**env)[0] for _ in range(size)]
        ids = [enqueue_run(AGENT, task("slow", n), connection=lab.r) for n in range(size)]
        started = _wait_events(lab, ids, ("tool_started",))
        lab.start("--concurrency", str(max(size, 2)), **env)  # the survivor, after every run has its worker
        killed = time.monotonic()
        for victim in victims:
            lab.workers.kill(victim)  # the worker and its horse
        resumed = _wait_events(lab, ids, RESUMED, after={i: started[i][0] for i in ids}, timeout=ttl + 60)
        times += [resumed[i][1] - killed for i in ids]
    return times


def _wait_events(
    lab: Lab, run_ids: list[str], kinds: tuple[str, ...], after: Any = "0-0", timeout: float = 60
) -> dict[str, tuple[str, float]]:
    """For each run, the id of its first event of ``kinds`` after ``after`` and when it was read."""
    from agentpool.store.keys import RunKeys

    cursors = {RunKeys.of(i).events: (after[i] if isinstance(after, dict) else after) for i in run_ids}
    runs = {RunKeys.of(i).events: i for i in run_ids}
    found: dict[str, tuple[str, float]] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(run_ids):
        if time.monotonic() > deadline:
            missing = [i for i in run_ids if i not in found]
            raise click.ClickException(f"no {kinds} event for {missing}; worker logs:\n{lab.workers.logs(2000)}")
        waiting = {k: c for k, c in cursors.items() if runs[k] not in found}
        replies: list[Any] = lab.r.xread(waiting, block=200) or []  # type: ignore[arg-type, assignment]
        seen = time.monotonic()
        for raw_key, rows in replies:
            key = raw_key.decode()
            for event_id, fields in rows:
                cursors[key] = event_id.decode()
                if fields[b"kind"].decode() in kinds and runs[key] not in found:
                    found[runs[key]] = (event_id.decode(), seen)
    return found


# -- the command -------------------------------------------------------------------------------


@contextmanager
def _lab(url: str | None) -> Iterator[Lab]:
    from agentpool.testing.localpool import scratch_dir

    lab = Lab(url, scratch_dir("agentpool-bench-"))
    try:
        yield lab
    finally:
        lab.close()


@click.command()
@click.option("--url", "-u", default=None, help="An empty Redis database to use (default: a redis-server of its own).")
@click.option("--only", type=click.Choice(SECTIONS), multiple=True, help="Run only these sections (repeatable).")
@click.option(
    "--turns",
    type=click.IntRange(min=10),
    default=60,
    show_default=True,
    help="overhead: jobs per measurement on the forking worker.",
)
@click.option(
    "--threaded-turns",
    type=click.IntRange(min=10),
    default=400,
    show_default=True,
    help="overhead: jobs per measurement on the threaded worker (a few seconds' worth).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="overhead: interleaved rounds of each measurement.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=2),
    default=8,
    show_default=True,
    help="overhead, recovery: --concurrency of the threaded worker.",
)
@click.option(
    "--save-turns",
    type=click.IntRange(min=2),
    default=200,
    show_default=True,
    help="saves: turns per run (the late figure is at this turn).",
)
@click.option(
    "--save-runs",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="saves: runs, i.e. samples per figure.",
)
@click.option(
    "--high-concurrency",
    type=click.IntRange(min=2),
    default=200,
    show_default=True,
    help="memory: --concurrency of the threaded worker.",
)
@click.option("--hold", type=float, default=2.0, show_default=True, help="memory: seconds the model takes to answer.")
@click.option("--trials", type=click.IntRange(min=1), default=20, show_default=True, help="recovery: kills per row.")
@click.option("--lease-ttl", type=float, default=None, help="recovery: lease TTL (default AGENTPOOL_LEASE_TTL, 15).")
@click.option(
    "--short-ttl",
    type=float,
    default=3.0,
    show_default=True,
    help="recovery: also kill whole workers under this shorter TTL (0: skip).",
)
@click.option(
    "--backlog",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="recovery: turns queued behind the crashed run in the 'under load' rows.",
)
@click.option(
    "--deferred-runs", type=click.IntRange(min=1), default=12, show_default=True, help="deferred: runs backing off."
)
@click.option(
    "--durability-runs",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="durability: runs of 10 turns per level and round.",
)
@click.option(
    "--long-turns",
    type=click.IntRange(min=20),
    default=500,
    show_default=True,
    help="long: the late point of the long run (compared with --long-early; at least it + 30).",
)
@click.option("--long-early", type=click.IntRange(min=10), default=100, show_default=True, help="long: the early run.")
@click.option(
    "--deltas", type=click.IntRange(min=10), default=200, show_default=True, help="long: deltas watched live."
)
@click.option("--limit-runs", type=click.IntRange(min=1), default=300, show_default=True, help="limits: runs.")
@click.option("--limit-turns", type=click.IntRange(min=1), default=5, show_default=True, help="limits: turns per run.")
@click.option(
    "--limit-workers", type=click.IntRange(min=1), default=4, show_default=True, help="limits: threaded workers."
)
@click.option(
    "--limit-concurrency", type=click.IntRange(min=1), default=50, show_default=True, help="limits: --concurrency."
)
@click.option(
    "--limit-minute",
    type=click.FloatRange(min=0.5),
    default=30.0,
    show_default=True,
    help="limits: seconds a rate-limit minute lasts (the limits are kept: same ratios, faster).",
)
@click.option("--limit-rpm", type=click.IntRange(min=1), default=600, show_default=True, help="limits: requests.")
@click.option(
    "--limit-itpm", type=click.IntRange(min=1), default=200_000, show_default=True, help="limits: input tokens."
)
@click.option(
    "--tenant-big", type=click.IntRange(min=1), default=1000, show_default=True, help="limits: the big tenant's runs."
)
@click.option(
    "--tenant-small", type=click.IntRange(min=1), default=10, show_default=True, help="limits: the small tenant's runs."
)
@click.option(
    "--tenant-max",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="limits: each tenant's max_concurrency.",
)
@click.option(
    "--tenant-delay",
    type=click.FloatRange(min=0),
    default=0.2,
    show_default=True,
    help="limits: seconds each model call of the tenants' runs takes.",
)
@click.option(
    "--webhook-runs", type=click.IntRange(min=1), default=50, show_default=True, help="limits: runs with a webhook."
)
@click.option(
    "--webhook-down",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="limits: seconds the webhook receiver is down (after failing 3 deliveries).",
)
@click.option(
    "--redis-turns",
    type=click.IntRange(min=20),
    default=400,
    show_default=True,
    help="redis, instructions: turns measured.",
)
@click.option(
    "--redis-rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="redis: interleaved rounds of every row (each figure is the median of its rounds, CPU with its range).",
)
@click.option(
    "--capacity-turns",
    type=click.IntRange(min=TURNS_PER_RUN),
    default=400,
    show_default=True,
    help="capacity: turns recorded (whole runs of 10).",
)
@click.option(
    "--capacity-copies",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="capacity: copies of the recording replayed at once (each on its own connection).",
)
@click.option(
    "--capacity-rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="capacity: interleaved replays of every recording (each figure is the median of its rounds).",
)
@click.option(
    "--shard-turns", type=click.IntRange(min=20), default=400, show_default=True, help="shards: turns measured."
)
@click.option(
    "--shard-rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="shards: interleaved rounds of one shard and two (each figure is the median of its rounds).",
)
@click.option(
    "--footprint-runs", type=click.IntRange(min=1), default=50, show_default=True, help="footprint: runs measured."
)
@click.option(
    "--footprint-turns", type=click.IntRange(min=2), default=20, show_default=True, help="footprint: turns a run."
)
@click.option(
    "--versus",
    "versus_rev",
    default="9d18c7d",
    show_default=True,
    help="versus: the git revision measured beside this checkout (issue 22's baseline by default).",
)
@click.option(
    "--versus-runs", type=click.IntRange(min=1), default=30, show_default=True, help="versus: runs of 10 turns."
)
@click.option(
    "--versus-rounds",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="versus: interleaved rounds of each revision (each figure is the median of its rounds).",
)
def bench(
    url: str | None,
    only: tuple[str, ...],
    turns: int,
    threaded_turns: int,
    rounds: int,
    threads: int,
    save_turns: int,
    save_runs: int,
    high_concurrency: int,
    hold: float,
    trials: int,
    lease_ttl: float | None,
    short_ttl: float,
    backlog: int,
    deferred_runs: int,
    durability_runs: int,
    long_turns: int,
    long_early: int,
    deltas: int,
    limit_runs: int,
    limit_turns: int,
    limit_workers: int,
    limit_concurrency: int,
    limit_minute: float,
    limit_rpm: int,
    limit_itpm: int,
    tenant_big: int,
    tenant_small: int,
    tenant_max: int,
    tenant_delay: float,
    webhook_runs: int,
    webhook_down: float,
    redis_turns: int,
    redis_rounds: int,
    capacity_turns: int,
    capacity_copies: int,
    capacity_rounds: int,
    shard_turns: int,
    shard_rounds: int,
    footprint_runs: int,
    footprint_turns: int,
    versus_rev: str,
    versus_runs: int,
    versus_rounds: int,
) -> None:
    """Measure agentpool on this machine: per-turn overhead, save cost, memory, crash recovery."""
    from agentpool.runtime.settings import Settings

    ttl = lease_ttl if lease_ttl is not None else Settings.from_env().lease_ttl
    sections = only or SECTIONS
    click.echo(f"agentpool bench: {', '.join(sections)} ({os.cpu_count()} CPUs; figures from this machine only)")
    with _lab(url) as lab:
        click.echo(
            f"redis {lab.r.info('server')['redis_version']} at {lab.url}; scripted model at {lab.model.base_url}"
        )
        if "overhead" in sections:
            from agentpool.ops.bench_long import bench_streaming

            bench_overhead(lab, turns, threaded_turns, threads, rounds)
            bench_streaming(lab, turns, threaded_turns, threads, rounds)
        if "saves" in sections:
            bench_saves(lab, save_turns, save_runs)
        if "memory" in sections:
            bench_memory(lab, high_concurrency, hold)
        if "footprint" in sections:
            from agentpool.ops.bench_footprint import bench_footprint

            bench_footprint(lab, footprint_runs, footprint_turns, (200, 4_000))
        if "recovery" in sections:
            bench_recovery(lab, trials, ttl, short_ttl, threads)
            bench_recovery_under_load(lab, min(trials, 5), backlog, short_ttl or ttl)
        if "deferred" in sections:
            from agentpool.ops.bench_ha import bench_deferred

            bench_deferred(lab, deferred_runs, threads)
        if "durability" in sections:
            from agentpool.ops.bench_ha import bench_durability

            bench_durability(durability_runs, rounds)
        if "long" in sections:
            from agentpool.ops.bench_long import bench_long

            bench_long(lab, long_turns, min(long_early, long_turns), deltas)
        if "limits" in sections:
            from agentpool.ops.bench_limits import bench_limits, bench_tenants
            from agentpool.ops.bench_webhooks import bench_webhooks

            bench_limits(
                lab, limit_runs, limit_turns, limit_workers, limit_concurrency, limit_minute, limit_rpm, limit_itpm
            )
            bench_tenants(
                lab, tenant_big, tenant_small, limit_turns, limit_workers, 2 * tenant_max + 2, tenant_max, tenant_delay
            )
            bench_webhooks(lab, webhook_runs, webhook_down, 2)
        if "redis" in sections:
            from agentpool.ops.bench_redis import bench_redis

            bench_redis(lab, redis_turns, threads, redis_rounds)
        if "instructions" in sections:
            from agentpool.ops.bench_instructions import bench_instructions

            bench_instructions(redis_turns, threads, asked="instructions" in only)
        if "capacity" in sections:
            from agentpool.ops.bench_capacity import bench_capacity

            bench_capacity(lab, capacity_turns, threads, capacity_copies, capacity_rounds)
        if "shards" in sections:
            from agentpool.ops.bench_shards import bench_shards

            bench_shards(lab, shard_turns, threads, shard_rounds)
        if "versus" in sections:
            from agentpool.ops.bench_versus import bench_versus

            bench_versus(lab, versus_rev, versus_runs, threads, versus_rounds, asked="versus" in only)
