"""``agentpool bench`` in tiny configurations: each section runs against real processes and prints its
table. Only the structure is checked; the figures depend on the machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from agentpool.ops.bench_capacity import OURS_LONG

from conftest import ROOT

# Each section runs its real pool for up to a minute and a half, much of it CPU-bound: CI runs them with the
# kill tests (the README's kill-test command), apart from the quick suite.
pytestmark = pytest.mark.bench

NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?x?$")

SECTIONS = {
    "overhead": (
        ["--turns", "10", "--threaded-turns", "10", "--rounds", "1", "--threads", "2"],
        "overhead: agentpool turn vs bare RQ job",
        ["bare RQ job: no-op", "bare RQ job: model call + tool", "agentpool turn"],
        6,
    ),
    "saves": (
        ["--save-turns", "3", "--save-runs", "2"],
        "saves: one run's store calls at turn 1 and at turn 3",
        ["load", "save point A", "save point B", "ledger outcome", "all writes of the turn"],
        5,
    ),
    "memory": (
        ["--high-concurrency", "4", "--hold", "0.5"],
        "memory: turns in flight per GB",
        ["forking (--concurrency 1)", "threaded (--concurrency 4)"],
        2,
    ),
    "footprint": (
        ["--footprint-runs", "3", "--footprint-turns", "3"],
        "footprint: Redis memory a finished run holds",
        ["3 turns, results of 200 chars", "3 turns, results of 4,000 chars"],
        2,
    ),
    "recovery": (
        ["--trials", "2", "--threads", "2", "--lease-ttl", "2", "--short-ttl", "0", "--backlog", "4"],
        "recovery: SIGKILL while a turn runs a slow tool",
        ["work horse killed", "threaded worker process killed", "whole worker killed"],
        3,
    ),
    "deferred": (
        ["--deferred-runs", "3", "--threads", "2"],
        "deferred turns: due time -> turn started",
        ["3"],
        1,
    ),
    "durability": (
        ["--durability-runs", "2", "--rounds", "1"],
        "durability: ms per turn",
        ["0 acks", "WAIT 1 replica"],
        2,
    ),
    "long": (
        ["--long-turns", "50", "--long-early", "10", "--deltas", "20"],
        "long: one run at turns 10-39 and at turns 50-79",
        ["request bytes, max", "window ms, mean", "whole ms"],
        6,
    ),
    "limits": (
        [
            *("--limit-runs", "4", "--limit-turns", "2", "--limit-workers", "1", "--limit-concurrency", "2"),
            *("--limit-minute", "2", "--limit-rpm", "4", "--limit-itpm", "4000"),
            *("--tenant-big", "20", "--tenant-small", "2", "--tenant-max", "2", "--tenant-delay", "0.05"),
            *("--webhook-runs", "3", "--webhook-down", "2"),
        ],
        "limits: 4 runs of 2 turns",
        ["limiter off (today)", "limiter on (learned)"],
        2,
    ),
    "redis": (
        ["--redis-turns", "20", "--threads", "2", "--redis-rounds", "2"],
        "redis: Redis commands and Redis CPU per turn",
        # Redis on a CPU of its own needs a second CPU for the pool.
        [
            "bare RQ job (no-op), back to back",
            "agentpool turn",
            "bare RQ job (no-op), turns' rate",
            "round trip alone (PING), same rate",
            "agentpool turn, rate limits learned",
            "agentpool turn, the forking turns' rate",
            "shares all",
            *(["own CPU"] if len(os.sched_getaffinity(0)) > 1 else []),
        ],
        4,
    ),
    "instructions": (
        ["--redis-turns", "20", "--threads", "2"],
        "instructions: Redis instructions per turn, counted by callgrind",
        ["bare RQ job (no-op)", "agentpool turn", "agentpool turn, rate limits learned"],
        6,
    ),
    "capacity": (
        ["--capacity-turns", "80", "--capacity-copies", "4", "--capacity-rounds", "2", "--threads", "2"],
        "capacity: a Redis core kept busy by 4 copies of a recorded pool",
        ["bare RQ job (no-op)", "agentpool turn"],
        3,
    ),
    # Against HEAD (a shallow clone has it): git archive, its workers and app on PYTHONPATH, and the same
    # code measured twice (check_the_same_code_measured_alike).
    "versus": (
        ["--versus", "HEAD", "--versus-runs", "3", "--versus-rounds", "2", "--threads", "2"],
        "versus: this checkout against HEAD, Redis per turn",
        ["HEAD (the baseline)", "this checkout", "threaded (--concurrency 2)", "forking (--concurrency 1)"],
        4,
    ),
    "shards": (
        ["--shard-turns", "20", "--threads", "2", "--shard-rounds", "2"],
        "shards: the same runs on one Redis and on two shards",
        ["one shard", "one shard, at each shard's rate", "two shards"],
        3,
    ),
}
# Sections that print more tables: [(its title, its rows)].
MORE_TABLES = {
    "overhead": [
        ("overhead: a turn whose model call streams", ["forking (--concurrency 1)", "threaded (--concurrency 2)"]),
    ],
    "long": [("live: a streamed delta, from the scripted model's socket", [])],
    "recovery": [("recovery under load", ["work horse killed", "whole worker killed (reaper takes over)"])],
    "limits": [
        ("tenants: a small tenant's 2 runs", ["alone", "behind 20 queued runs of the big tenant"]),
        ("webhooks: 3 runs posted to a receiver", ["fails 3, down 2 s"]),
    ],
}

# What else a section's output must say: the ratios its targets are judged by, measured in the same run.
MORE_LINES = {
    "limits": ["limiter on (learned): the most commands a turn: "],
    "redis": [
        "CPU vs bare RQ",
        "forking turn / threaded turn, Redis shares all: commands",
        "against the threaded turn at the forking turns' rate: commands",
    ],
    "instructions": ["in scripts: inside EVAL and EVALSHA"],
    "capacity": ["forking turn / threaded turn at capacity: CPU"],
}
# What a section's output must show in a form (a regular expression): the redis section's medians of
# rounds, with the CPU's range and the forking ratio's.
MORE_PATTERNS = {
    "redis": [r"  \d+ \(\d+-\d+\)  ", r"CPU [\d.]+x \([\d.]+x-[\d.]+x\)", "2 rounds, interleaved"],
    "shards": [r"  \d+ \(\d+-\d+\)  ", r"  [\d.]+x \([\d.]+x-[\d.]+x\)  ", "2 rounds, interleaved"],
    # Debian's redis-server names the functions the split is read from (a stripped binary would not).
    "instructions": [r"threaded \(--concurrency 2\), agentpool turn, inside its scripts: commands they call \d+%"],
}


def run_bench(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "agentpool", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("section", SECTIONS)
def test_bench_section_prints_its_table_of_figures(section):
    args, title, rows, at_least = SECTIONS[section]
    out = run_bench("--only", section, *args)
    check_table(out, title, rows, at_least)
    for more_title, more_rows in MORE_TABLES.get(section, []):
        check_table(out, more_title, more_rows, 1)
    for line in MORE_LINES.get(section, []):
        assert line in out, out
    for pattern in MORE_PATTERNS.get(section, []):
        assert re.search(pattern, out), f"nothing like {pattern!r}:\n{out}"
    if section == "capacity":
        check_replay_did_what_the_pool_did(out)
    if section == "versus":
        check_the_same_code_measured_alike(out)
    if section == "footprint":
        check_a_run_holds_at_least_its_conversation(out)


def check_a_run_holds_at_least_its_conversation(out: str) -> None:
    """Each run's memory (what its keys and index entries hold) holds its conversation as stored, and the run with
    twenty times the tool output holds more."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.startswith("  3 turns, results")]
    per_run = [float(cells[1].replace(",", "")) for cells in rows]
    conversation = [float(cells[3].replace(",", "")) for cells in rows]
    assert len(rows) == 2 and all(run >= held for run, held in zip(per_run, conversation)), out
    assert per_run[1] > per_run[0] and conversation[1] > conversation[0], out


def check_the_same_code_measured_alike(out: str) -> None:
    """HEAD's archive, run from its own directory, and this checkout are the same code: each made every turn
    (the bench checks the model's calls) in the same commands, so the revision run from the archive really
    ran, and ran what it holds."""
    ratios = [float(r) for r in re.findall(r"this checkout / HEAD, \w+ \(--concurrency \d+\): commands ([\d.]+)x", out)]
    assert len(ratios) == 2 and all(0.95 <= ratio <= 1.05 for ratio in ratios), out


def check_replay_did_what_the_pool_did(out: str) -> None:
    """The capacity figures are only worth something if the copies of the recorded pool did its work: each
    turn's scripts ran through (a copy whose leases or fences failed would stop early, in about half the
    commands), and its replies were of the kinds the pool got, but for the few that depend on Redis's clock."""
    turns = [line for line in out.splitlines() if line.startswith("  agentpool turn")]
    assert len(turns) == 3, out
    for line in turns:
        cells = re.split(r"\s{2,}", line.strip())
        commands = float(cells[3])
        # A long call's turn adds its lease renewals (a script of three commands each, about two a turn), and
        # the pool's background over its ten seconds (the reaper's scans, idle threads' dequeue waits) is
        # spread over this test's few turns.
        most = 70 if cells[0].startswith(OURS_LONG) else 45
        assert 30 <= commands <= most, f"a replayed turn ran {commands} commands (the pool runs about 37):\n{out}"
        unlike, replies = (int(n.replace(",", "")) for n in re.fullmatch(r"([\d,]+) of ([\d,]+)", cells[-1]).groups())
        assert unlike <= 0.05 * replies, f"{unlike} of {replies} replies unlike the recording:\n{out}"
    # The long call's turns held their leases through renewals, as a real 10 s call's do, and none lapsed.
    renewals, acquired = re.search(r"([\d.]+) lease renewals a turn.*?([\d.]+) lease acquisitions a turn", out).groups()
    assert 1 <= float(renewals) <= 3 and float(acquired) <= 1.05, out


def check_table(out: str, title: str, rows: list[str], at_least: int) -> None:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    body = [line for line in lines[start + 2 : end] if not line.startswith("  note:")]
    header = lines[start + 1]
    assert "target" in header, header
    assert len(body) >= at_least, out
    for label in rows:
        assert any(label in line for line in body), f"no row for {label!r}:\n{out}"
    for line in body:
        numbers = [cell for cell in re.split(r"\s{2,}", line.strip()) if NUMBER.match(cell)]
        assert numbers, f"a row without figures: {line}"
