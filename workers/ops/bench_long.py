"""``agentpool bench``'s figures for long runs (in a module of their own; ``bench.py`` holds the lab):

- ``overhead`` also times a turn whose model call streams against one whose call does not, on each
  worker class (workers started with ``AGENTPOOL_MODEL_STREAMING`` 1 and 0, in alternating rounds);
- ``long``: a 500-turn run with 4 KB tool results and agentpool's compaction at 30,000 tokens, next to
  the same run stopped at turn 100: the request the model received and the turn's load (the window),
  at each; and how long a streamed delta takes to reach a watcher (``agentpool.watch``) after the
  scripted model sent it.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import click

from agentpool.agent import Agent, Compaction
from agentpool.ops.bench import (
    MODEL,
    TURNS_PER_RUN,
    Lab,
    _agentpool_rate,
    bench_lookup,
    pct,
    table,
    tool_steps,
    until,
)
from agentpool.store.keys import RunKeys
from agentpool.tools import tool

LONG_AGENT = "agentpool.ops.bench_long:long_agent"
PAGE_BYTES = 4_000
TRIGGER = 30_000


@tool(effect="read")
def bench_page(page: int) -> str:
    """Read a 4 KB page."""
    line = f"page {page}: a line of the archive that the agent reads and mostly forgets. "
    return (line * (PAGE_BYTES // len(line) + 1))[:PAGE_BYTES]


long_agent = Agent(
    model=MODEL,
    system="You read an archive, one page a turn.",
    tools=[bench_page, bench_lookup],
    max_turns=1_000,
    max_tokens=256,
    max_total_tokens=None,
    # Below the API's minimum trigger (50,000): agentpool's own compaction, by a summary call.
    compaction=Compaction(trigger=TRIGGER, server_side=False),
)


# -- streaming vs not, in the overhead section -----------------------------------------------------


def bench_streaming(lab: Lab, turns: int, threaded_turns: int, threads: int, rounds: int) -> None:
    rows = []
    for kind, args, n in (
        ("forking (--concurrency 1)", (), turns),
        (f"threaded (--concurrency {threads})", ("--concurrency", str(threads)), threaded_turns),
    ):
        lab.reset({"overhead": tool_steps(TURNS_PER_RUN)})
        rates: dict[str, list[float]] = {"streamed": [], "not streamed": []}
        cpu: dict[str, list[float]] = {"streamed": [], "not streamed": []}
        for _ in range(rounds):  # alternating, so a change in the machine's load hits both alike
            for mode, flag in (("streamed", "1"), ("not streamed", "0")):
                proc, _name = lab.start(*args, AGENTPOOL_MODEL_STREAMING=flag)
                _agentpool_rate(lab, TURNS_PER_RUN)  # warm: the client, its connections, the imports
                before = _cpu_seconds(proc.pid)
                rates[mode].append(_agentpool_rate(lab, n))
                cpu[mode].append((_cpu_seconds(proc.pid) - before) * 1000 / n)
                proc.send_signal(signal.SIGTERM)  # idle: a warm shutdown is immediate
                proc.wait(timeout=60)
        ms = {mode: 1000 / statistics.median(r) for mode, r in rates.items()}
        cpu_ms = {mode: statistics.median(c) for mode, c in cpu.items()}
        rows.append(
            [
                kind,
                f"{ms['not streamed']:.2f}",
                f"{ms['streamed']:.2f}",
                f"{ms['streamed'] / ms['not streamed']:.2f}x",
                f"{cpu_ms['not streamed']:.2f}",
                f"{cpu_ms['streamed']:.2f}",
                f"{cpu_ms['streamed'] / cpu_ms['not streamed']:.2f}x",
                "<= 1.10x",
            ]
        )
    table(
        "overhead: a turn whose model call streams vs the same turn with one non-streaming create()",
        ["worker", "not ms/turn", "streamed ms/turn", "ratio", "not CPU ms", "streamed CPU ms", "CPU ratio", "target"],
        rows,
        (
            (
                f"{rounds} alternating rounds of each (a worker started with AGENTPOOL_MODEL_STREAMING=1, then =0); "
                "ms/turn = 1000 / the median round's turns per second (the whole machine: worker, Redis and the "
                "scripted model share its CPUs); CPU ms = the worker processes' CPU time per turn (work horses "
                "included), median round; nobody watches (no live output is written)"
            ),
        ),
    )


def _cpu_seconds(pid: int) -> float:
    """User and system CPU of ``pid`` and of its children, reaped (work horses) or alive (a supervisor's worker)."""
    from agentpool.testing.localpool import children_of

    total, pending, first = 0.0, [pid], True
    while pending:
        current = pending.pop()
        pending += children_of(current)
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        # utime, stime, cutime, cstime: fields 14 to 17, the 12th to 15th after the command's ")".
        ticks = [int(x) for x in stat.rsplit(")", 1)[1].split()[11:15]]
        total += sum(ticks) if first else ticks[0] + ticks[1]
        first = False
    return total / os.sysconf("SC_CLK_TCK")


# -- long runs ------------------------------------------------------------------------------------------


CYCLE = 30  # turns walked past each point: more than one compaction cycle (about 25 turns here)


def _walk(lab: Lab, run_id: str, turns: int) -> dict[str, list[float]]:
    """From the stopped run's turn on, one turn at a time for ``CYCLE`` turns: the request the model got
    for the turn, and the turn's load (header and window, one round trip) p50 of 20, and for contrast
    the whole history's load."""
    from agentpool.client import resume
    from agentpool.store import checkpoint, window

    def p50(load: Any, repeat: int = 20) -> float:
        samples = []
        for _ in range(repeat):
            started = time.perf_counter()
            load()
            samples.append((time.perf_counter() - started) * 1000)
        return pct(samples, 50)

    seen: dict[str, list[float]] = {"request bytes": [], "window ms": [], "window messages": [], "whole ms": []}
    for step in range(CYCLE):
        if step:
            resume(run_id, add_turns=1, connection=lab.r)
            _until_stopped(lab, run_id, turns + step)
        seen["request bytes"].append(lab.model.stats()["request_bytes"][-1])
        seen["window ms"].append(p50(lambda: window.load(lab.r, run_id)))
        seen["window messages"].append(len(window.load(lab.r, run_id).messages))
        seen["whole ms"].append(p50(lambda: checkpoint.load_run(lab.r, run_id), 5))
    return seen


def _until_stopped(lab: Lab, run_id: str, turns: int) -> None:
    header = RunKeys.of(run_id).run
    until(lambda: lab.r.hget(header, "status") not in (b"queued", b"running"), 120 + turns, "the long run", lab, 0.01)
    status, done = lab.r.hmget(header, "status", "turns")
    if status != b"stopped" or int(done or 0) != turns:
        raise click.ClickException(f"the long run is {status!r} at turn {done!r}, not stopped at {turns}")


def bench_long(lab: Lab, turns: int, early: int, deltas: int) -> None:
    from agentpool.client import enqueue_run, resume

    if turns < early + CYCLE:
        raise click.ClickException(f"--long-turns must be at least --long-early + {CYCLE}")
    script = [{"tool_calls": [{"name": "bench_page", "input": {"page": i}}]} for i in range(turns + CYCLE)]
    lab.reset({"long": [*script, {"text": "done"}]})
    lab.start("--concurrency", "4")
    run_id = enqueue_run(LONG_AGENT, "bench long run [script:long]", max_turns=early, connection=lab.r)
    _until_stopped(lab, run_id, early)
    walks = {early: _walk(lab, run_id, early)}
    resume(run_id, add_turns=turns - early - CYCLE + 1, connection=lab.r)
    _until_stopped(lab, run_id, turns)
    walks[turns] = _walk(lab, run_id, turns)
    rows = []
    for name, how, target in (
        ("request bytes", max, "<= 1.2x"),
        ("request bytes", statistics.mean, ""),
        ("window ms", max, ""),
        ("window ms", statistics.mean, "<= 1.2x"),
        ("window messages", max, ""),
        ("whole ms", statistics.mean, ""),
    ):
        a, b = how(walks[early][name]), how(walks[turns][name])
        fmt = "{:,.3f}" if "ms" in name else "{:,.0f}"
        label = f"{name}, {'max' if how is max else 'mean'}"
        rows.append([label, fmt.format(a), fmt.format(b), f"{b / a:.2f}x", target])
    table(
        f"long: one run at turns {early}-{early + CYCLE - 1} and at turns {turns}-{turns + CYCLE - 1}, 4 KB tool "
        f"results, agentpool's compaction at {TRIGGER:,} tokens",
        ["figure", f"turn {early}+", f"turn {turns}+", "ratio", "target"],
        rows,
        (
            (
                f"over {CYCLE} turns from each point (more than a compaction cycle: the window grows, then starts "
                "again from a summary); request = the bytes of the turn's POST /v1/messages"
            ),
            (
                "window = what a turn loads (header and window in one round trip, p50 of 20 at each turn); "
                "whole = the whole conversation (get_run), for contrast"
            ),
        ),
    )
    _bench_watch_latency(lab, deltas)


def _bench_watch_latency(lab: Lab, deltas: int) -> None:
    """A watcher in this process; the scripted model stamps each text delta as it leaves."""
    from agentpool.client import enqueue_run, new_run_id
    from agentpool.store import live
    from agentpool.watching import watch

    words = "".join(f"w{i:05d} " for i in range(deltas))
    lab.reset({"talk": [{"text": words.strip(), "stream": {"chunk": 7, "interval": 0.02}}]})
    lab.start()
    run_id = new_run_id()
    live.mark_watching(lab.r, RunKeys.of(run_id))  # watched from its first turn on, as a dashboard would
    enqueue_run(LONG_AGENT, "bench watch [script:talk]", run_id=run_id, connection=lab.r)
    seen: dict[str, float] = {}

    def follow() -> None:
        for item in watch(run_id, connection=lab.r):
            if item["type"] == "text_delta":
                now = time.monotonic()
                for word in item["text"].split():
                    seen.setdefault(word, now)

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    watcher.join(timeout=60 + deltas * 0.05)
    sent = {text.strip(): at for at, text in lab.model.delta_times()}
    latencies = [(seen[word] - at) * 1000 for word, at in sent.items() if word in seen]
    if len(latencies) < deltas * 0.9:
        raise click.ClickException(f"the watcher saw {len(latencies)} of {deltas} deltas")
    table(
        "live: a streamed delta, from the scripted model's socket to a watcher's iterator (agentpool.watch)",
        ["deltas", "p50 ms", "p95 ms", "max ms", "target"],
        [
            [
                str(len(latencies)),
                f"{pct(latencies, 50):.1f}",
                f"{pct(latencies, 95):.1f}",
                f"{max(latencies):.1f}",
                "p50 <= 50 ms",
            ]
        ],
        (
            (
                "one word a delta, 20 ms apart; the watcher arrives when the run is enqueued, so the worker publishes "
                "from the first delta; the worker coalesces deltas for 25 ms at most"
            ),
        ),
    )
