"""``agentpool bench --only versus``: Redis's commands and CPU per turn of this checkout beside another
revision's (by default issue 22's baseline, ``9d18c7d``), measured in the same run, on the same Redis.

At the workers' own pace the same code's Redis CPU per turn wanders by up to two times between runs on one
machine, and as much between machines of one size, so a figure measured elsewhere cannot be set against
today's: the issue's baseline, 543 µs a turn, was measured on a faster machine than this one. This section
measures both revisions as the issue measured its baseline, in interleaved rounds: one threaded worker
(``--concurrency``), runs of ``TURNS_PER_RUN`` trivial tool turns enqueued by an app process, Redis's
``INFO commandstats`` and ``INFO cpu`` from the first enqueue to the last turn's end, net of what the idle
pool costs for as long (``agentpool.ops.bench_redis``), Redis on a CPU of its own.

The other revision is taken with ``git archive`` out of the git checkout this agentpool runs from (an
editable install of a clone) into a scratch directory, and its workers and its app process import it
from there (``PYTHONPATH``). The Redis, the scripted model, the bench agent's script and the measurement
are this checkout's; the bench agent (``agentpool.ops.bench:bench_agent``) is each revision's own.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import click

import agentpool
from agentpool.ops.bench import AGENT, TURNS_PER_RUN, Lab, spread, table, tool_steps
from agentpool.ops.bench_redis import Sample, _idle, _measure, _per_turn, _Placement, done_within
from agentpool.store.keys import RUNS_WATCH

SCRIPT = "versus"
# The app process: each revision's own enqueue_run (``check_agent`` came later; the agent is not imported).
ENQUEUE = """
import inspect, sys
from redis import Redis
from agentpool import enqueue_run
r = Redis.from_url(sys.argv[1])
unchecked = {"check_agent": False} if "check_agent" in inspect.signature(enqueue_run).parameters else {}
for i in range(int(sys.argv[2])):
    enqueue_run(sys.argv[3], f"bench task {sys.argv[4]}-{i} [script:{sys.argv[5]}]", connection=r, **unchecked)
"""


def _repo() -> Path:
    """The checkout this agentpool is installed from (``workers/`` is the package)."""
    return Path(agentpool.__file__).resolve().parent.parent


def checkout(rev: str, into: Path) -> Path:
    """``rev`` of the git checkout this agentpool is installed from, extracted under ``into``: the directory
    to put on ``PYTHONPATH`` for ``import agentpool`` to be that revision's (``workers/`` is the package,
    ``store/`` its ``agentpool.store``, as pyproject.toml maps them)."""
    repo = _repo()
    if not shutil.which("git"):
        raise click.ClickException("versus: git is not installed (Debian/Ubuntu: apt-get install -y git)")
    found = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        raise click.ClickException(
            f"versus: {rev!r} is not a commit of {repo}: this section needs agentpool installed from a git clone "
            "(pip install -e .) that holds that revision (a shallow clone may not)"
        )
    archive = into / "source.tar"
    subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", "-o", str(archive), rev], check=True)
    source = into / "source"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    if not (source / "workers" / "__init__.py").exists() or not (source / "store").is_dir():
        raise click.ClickException(f"versus: {rev} has no workers/ and store/ at its top: not a layout this bench runs")
    if not (source / "workers" / "store").exists():
        (source / "workers" / "store").symlink_to(source / "store")
    path = into / "path"
    path.mkdir()
    (path / "agentpool").symlink_to(source / "workers")
    # Its processes must import it, not the installed agentpool (which an import hook could put first).
    imported = subprocess.run(
        [sys.executable, "-c", "import agentpool; print(agentpool.__file__)"],
        env={**os.environ, "PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
        check=False,
    )
    if not imported.stdout.strip().startswith(str(path)):
        raise click.ClickException(f"versus: with PYTHONPATH={path}, agentpool is imported from {imported.stdout!r}")
    return path


def _round(
    lab: Lab, pythonpath: str | None, worker_args: tuple[str, ...], runs: int, tag: str
) -> tuple[Sample, Sample, int]:
    """One revision's measurement on one worker (``pythonpath``: None for this checkout): its sample, its
    idle pool's, and the model calls it made (each turn makes one)."""
    env = {"PYTHONPATH": pythonpath} if pythonpath else {}
    lab.reset({SCRIPT: tool_steps(TURNS_PER_RUN)})
    lab.start(*worker_args, **env)
    app_env = {**lab.workers.env, **env}

    def enqueue(n: int, name: str) -> None:
        command = [sys.executable, "-c", ENQUEUE, lab.url, str(n), AGENT, name, SCRIPT]
        app = subprocess.run(command, env=app_env, cwd=lab.workers.cwd, check=False, capture_output=True, text=True)
        if app.returncode != 0:
            raise click.ClickException(f"versus: the app process could not enqueue the runs:\n{app.stderr[-2000:]}")

    def ended(n: int) -> Callable[[], bool]:  # ended runs leave the watch set
        return done_within(120 + 5 * n * TURNS_PER_RUN, f"{n} runs ({tag})", lab, lambda: lab.r.zcard(RUNS_WATCH) == 0)

    _measure(lab, lambda: enqueue(1, f"{tag}-warm"), ended(1))  # imports, connections, scripts loaded
    idle = _idle(lab)
    calls = lab.model.stats()["responses"]
    sample = _measure(lab, lambda: enqueue(runs, tag), ended(runs))
    return sample, idle, lab.model.stats()["responses"] - calls


def bench_versus(lab: Lab, rev: str, runs: int, threads: int, rounds: int, *, asked: bool = True) -> None:
    """``asked``: the section was named with ``--only``; where ``rev`` cannot be had it then fails, where a
    run of every section says so and goes on with the others."""
    from agentpool.testing.localpool import scratch_dir

    try:
        other = str(checkout(rev, scratch_dir("agentpool-bench-versus-")))
    except click.ClickException as exc:
        if asked:
            raise
        click.echo(f"\n{exc.message}; not measured")
        return
    turns = runs * TURNS_PER_RUN
    revisions = {f"{rev} (the baseline)": other, "this checkout": None}
    workers = {f"threaded (--concurrency {threads})": ("--concurrency", str(threads)), "forking (--concurrency 1)": ()}
    Figures = tuple[float, float, float, float, float]  # bench_redis._per_turn's
    measured: dict[tuple[str, str], list[Figures]] = {(w, name): [] for w in workers for name in revisions}
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in measured}
    placement = _Placement(lab)
    try:
        placement.set(placement.can_isolate)
        for n in range(rounds):
            for (worker, name), figures in measured.items():
                sample, idle, calls = _round(lab, revisions[name], workers[worker], runs, f"r{n}")
                if calls != turns:
                    raise click.ClickException(f"versus: {name} made {calls} model calls for {turns} turns")
                figures.append(_per_turn(sample, idle, turns))
                rates[(worker, name)].append(turns / sample.seconds)
    finally:
        placement.set(False)
        lab.workers.stop()
    rows = []
    for (worker, name), figures in measured.items():
        commands, cpu, net_commands, net_cpu, reads = ([f[i] for f in figures] for i in range(5))
        ours_threaded = revisions[name] is None and worker.startswith("threaded")
        rows.append(
            [
                name,
                worker,
                f"{statistics.median(commands):.1f}",
                f"{statistics.median(net_commands):.1f}",
                "<= 40" if ours_threaded else "",
                f"{statistics.median(reads):.1f}",
                spread(cpu, ".0f"),
                spread(net_cpu, ".0f"),
                "<= 250" if ours_threaded else "",
                f"{statistics.median(rates[(worker, name)]):.0f}",
            ]
        )
    ratios = []
    for worker in workers:
        theirs, ours = (measured[(worker, name)] for name in revisions)
        cpu_ratio = [mine[3] / max(base[3], 1e-9) for mine, base in zip(ours, theirs)]
        command_ratio = statistics.median(mine[2] / base[2] for mine, base in zip(ours, theirs))
        ratios.append(
            f"this checkout / {rev}, {worker}: commands {command_ratio:.2f}x, Redis CPU {spread(cpu_ratio, '.2f', 'x')}"
        )
    table(
        (
            f"versus: this checkout against {rev}, Redis per turn ({turns} turns, {TURNS_PER_RUN} per run; "
            f"{rounds} round{'s' if rounds > 1 else ''})"
        ),
        [
            "revision",
            "worker",
            "commands",
            "net of idle",
            "target",
            "round trips",
            "CPU µs",
            "net of idle",
            "target",
            "turns/s",
        ],
        rows,
        (
            *ratios,
            (
                "issue 22's targets, from its baseline of 124 commands and 543 µs with the threaded worker: 40 "
                "commands and 250 µs, 0.32x and 0.46x of it; the forking worker within 1.2x of the threaded"
            ),
            (
                "measured as --only redis measures (INFO commandstats and INFO cpu from the first enqueue to the "
                "last turn's end, the bench's polls taken out, net of the idle pool for as long), the app a "
                "process of the revision's own; rounds interleaved, each ratio taken within a round"
            ),
            (
                f"Redis on a CPU of its own (of {len(placement.everything)}), the workers and the app on the others"
                if placement.can_isolate
                else "Redis shares the CPUs with the workers (not started by this bench, or one CPU)"
            ),
            f"{rev}: git archive of the checkout at {_repo()}",
        ),
    )
