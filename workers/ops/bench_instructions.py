"""``agentpool bench --only instructions``: what one turn costs Redis in instructions, counted by callgrind.

Redis's CPU time per turn (``--only redis``) moves with the machine and its load more than with the code:
the same code measured 217 and 495 µs a turn on two days. Valgrind's callgrind counts the instructions
redis-server runs instead, which for the same binary and the same work come out the same within about
one percent, whatever else the machine does. So a change to a script or to a turn's commands shows here
as a figure that can be compared from one day to the next.

This section runs a redis-server of its own under callgrind with counting off, and counts only while the
measured turns or bare RQ jobs run (``callgrind_control -i on`` / ``off``), dumping the count of each
window apart. What it leaves out: the kernel's side of each round trip (the socket reads, writes and
wake-ups: ``--only redis`` counts the round trips), and time: an instruction count is not a duration.
The idle pool's background (dequeue waits, the reaper, heartbeats, Redis's own cron) is counted alone for a
few seconds and taken out for as long as each window lasted, as ``--only redis`` does: the forking worker's
turns take several times longer than the threaded one's, so they would carry several times more of it.
The bench's own polls (a ``ZCARD`` a tenth of a second) stay in, a few hundred instructions a turn at most.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import click

from agentpool.ops.bench import TURNS_PER_RUN, Lab, table, tool_steps
from agentpool.ops.bench_redis import IDLE, POLL, Load, bare_load, limits_learned, runs_load

INSTALL_HINT = "valgrind is not installed (Debian/Ubuntu: apt-get install -y valgrind)"
TOTALS = re.compile(r"^totals:\s*(\d+)", re.MULTILINE)
# EVAL and EVALSHA run in this function: its inclusive count is what the scripts cost, commands included.
IN_SCRIPTS = "evalGenericCommand"
# Where a script's instructions go (Redis 7's function names; an older or stripped binary names none):
# luaCallFunction runs one call (its KEYS and ARGV made Lua strings, the script, its reply turned back),
# lua_pcall the script itself, and scriptCall each command the script calls, inside lua_pcall.
SCRIPT_PARTS = ("luaCallFunction", "lua_pcall", "scriptCall")


def _inclusive(annotated: str, function: str) -> int | None:
    """``function``'s inclusive count in ``callgrind_annotate --inclusive=yes`` output, whose lines read
    "70,004,988 (74.45%)  ???:evalGenericCommand [/usr/bin/redis-server]"; None if it is not named."""
    found = re.search(rf"^\s*([\d,]+) \([^)]*\)\s+\S*:{function} \[", annotated, re.MULTILINE)
    return int(found.group(1).replace(",", "")) if found else None


def script_split(annotated: str) -> str | None:
    """Of the instructions inside scripts: the commands they call, the Lua code around them, and the
    rest of each call (its arguments made Lua strings, its reply turned back, Lua's garbage collector)."""
    whole, pcall, commands = (_inclusive(annotated, name) for name in SCRIPT_PARTS)
    if not (whole and pcall and commands):
        return None
    return (
        f"commands they call {commands / whole:.0%}, the Lua code around them {(pcall - commands) / whole:.0%}, "
        f"their arguments and replies made Lua values and back {(whole - pcall) / whole:.0%}"
    )


class Callgrind:
    """A redis-server under callgrind, counting only inside ``count``."""

    def __init__(self, workdir: Path) -> None:
        from agentpool.testing.localpool import RedisServer

        self.out = workdir / "callgrind.out"
        self.server = RedisServer(
            workdir, wrapper=("valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.out}")
        )
        self.dumps = 0
        self.split: str | None = None

    def start(self) -> Callgrind:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def _control(self, *args: str) -> None:
        assert self.server.proc is not None
        subprocess.run(
            ["callgrind_control", *args, str(self.server.proc.pid)], check=True, capture_output=True, timeout=60
        )

    def count(self, load: Load) -> tuple[int, int | None, float]:
        """Redis's instructions while ``load`` runs to its end, those inside scripts (``EVAL``,
        ``EVALSHA``, with the commands they call; None when the binary does not name the function), and
        the seconds it took. ``self.split``: where the scripts' went (``script_split``)."""
        work, done = load
        self._control("-i", "on")
        started = time.monotonic()
        work()
        while not done():
            time.sleep(POLL)
        seconds = time.monotonic() - started
        self._control("-i", "off")
        self._control("-d")  # written to <out>.<n>; the counters start again from zero
        self.dumps += 1
        dump = Path(f"{self.out}.{self.dumps}")
        total = int(TOTALS.search(dump.read_text()).group(1))  # type: ignore[union-attr]
        annotated = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", str(dump)], capture_output=True, text=True, check=False
        ).stdout
        self.split = script_split(annotated)
        return total, _inclusive(annotated, IN_SCRIPTS), seconds


def _net(total: int, seconds: float, idle_per_second: float, turns: int) -> float:
    """Instructions a turn, less the idle pool's for as long as the window lasted."""
    return (total - idle_per_second * seconds) / turns


def bench_instructions(turns: int, threads: int, *, asked: bool = True) -> None:
    """``asked``: the section was named with ``--only``; without valgrind it then fails, where a run of
    every section says so and goes on with the others."""
    from agentpool.testing.localpool import scratch_dir

    if not (shutil.which("valgrind") and shutil.which("callgrind_control") and shutil.which("callgrind_annotate")):
        if asked:
            raise click.ClickException(f"instructions: {INSTALL_HINT}")
        click.echo(f"\ninstructions: not measured: {INSTALL_HINT}")
        return
    workdir = scratch_dir("agentpool-bench-callgrind-")
    callgrind = Callgrind(workdir).start()
    lab = Lab(callgrind.server.url, workdir)
    rows: list[list[str]] = []
    details: list[str] = []
    turn_figures: dict[str, float] = {}
    try:
        for kind, args in (
            ("forking (--concurrency 1)", ()),
            (f"threaded (--concurrency {threads})", ("--concurrency", str(threads))),
        ):
            lab.reset({"redis": tool_steps(TURNS_PER_RUN)})
            lab.start(*args)
            callgrind.count(runs_load(lab, TURNS_PER_RUN))  # warm: imports, connections, scripts loaded
            callgrind.count(bare_load(lab, 5))
            idle, _, idle_seconds = callgrind.count((lambda: time.sleep(IDLE), lambda: True))
            bare, _, bare_seconds = callgrind.count(bare_load(lab, turns))
            ours, ours_scripts, ours_seconds = callgrind.count(runs_load(lab, turns))
            if callgrind.split:
                details.append(f"{kind}, agentpool turn, inside its scripts: {callgrind.split}")
            with limits_learned(lab):
                limited, limited_scripts, limited_seconds = callgrind.count(runs_load(lab, turns))
            idle_rate = idle / idle_seconds
            bare_net = _net(bare, bare_seconds, idle_rate, turns)
            turn_figures[kind.split()[0]] = _net(ours, ours_seconds, idle_rate, turns)
            for job, total, scripts, seconds in (
                ("bare RQ job (no-op)", bare, None, bare_seconds),
                ("agentpool turn", ours, ours_scripts, ours_seconds),
                ("agentpool turn, rate limits learned", limited, limited_scripts, limited_seconds),
            ):
                net = _net(total, seconds, idle_rate, turns)
                rows.append(
                    [
                        kind,
                        job,
                        f"{total / turns / 1000:,.0f}",
                        f"{net / 1000:,.0f}",
                        f"{scripts / total:.0%}" if scripts is not None else "",
                        f"{net / bare_net:.2f}x",
                    ]
                )
            details.append(
                f"{kind}, idle pool: {idle_rate / 1000:,.0f} thousand instructions a second "
                f"(turns took {ours_seconds:.1f} s, bare jobs {bare_seconds:.1f} s)"
            )
    finally:
        lab.close()
        callgrind.stop()
    forking, threaded = turn_figures["forking"], turn_figures["threaded"]
    for row in rows:
        mine = row[1] == "agentpool turn"
        row.append(f"{forking / threaded:.2f}x" if mine and row[0].startswith("forking") else "")
        row.append("<= 1.2x" if mine and row[0].startswith("forking") else "")
    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    table(
        f"instructions: Redis instructions per turn, counted by callgrind ({turns} turns, {TURNS_PER_RUN} per run; "
        f"bare RQ: {turns} jobs)",
        [
            "worker",
            "job",
            "thousand instructions a turn",
            "net of idle",
            "in scripts",
            "vs bare RQ job",
            "forking turn vs threaded",
            "target",
        ],
        rows,
        (
            (
                f"counted by {version} (callgrind) in redis-server's own process while the turns ran: the same binary "
                "and work give the same count within about one percent, on any day; the kernel's side of each "
                "round trip is not in it (see --only redis for round trips and CPU time)"
            ),
            "net of idle: less what the idle pool runs a second (counted alone), for as long as the turns took",
            "in scripts: inside EVAL and EVALSHA, the commands they call included (of the whole count)",
            "vs bare RQ job, forking turn vs threaded: net of idle",
            (
                "forking turn vs threaded: issue 22's target for the forking worker's Redis CPU, here without the "
                "wake-ups its slower pace costs the kernel"
            ),
            *details,
        ),
    )
