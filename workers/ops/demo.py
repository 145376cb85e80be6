"""``agentpool demo``: a pool on this machine survives its workers being killed mid-turn.

It starts a throwaway redis-server (never the REDIS_URL an app's workers use: they would take the
demo's turns), or with ``--redis-url`` uses an empty database it wipes afterwards; starts the scripted
model (or, with --real and ANTHROPIC_API_KEY, the real API) and a few worker processes; enqueues a
batch of runs that read notes, open tickets and send emails; SIGKILLs a work horse (as the OOM killer
does) and then a whole worker, each while it runs a tool call; shows the runs finishing on the
survivors, then counts every side effect from the outbox the tools write, outside the pool. When
something goes wrong it says what: which runs did not complete and why, which effects were repeated,
and the tail of the workers' logs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import click
from redis import Redis

from agentpool.client import Run, enqueue_run, list_runs
from agentpool.ops.demo_agents import demo_script
from agentpool.ops.redisconn import quick_client
from agentpool.runtime import connections
from agentpool.runtime.progress import clock
from agentpool.runtime.settings import redact_url
from agentpool.store import lease
from agentpool.store.events import read as read_events
from agentpool.store.events import stream_order
from agentpool.store.keys import RunKeys
from agentpool.store.records import ACTIVE_STATUSES
from agentpool.testing.localpool import (
    RedisNotInstalled,
    RedisServer,
    WorkerProcesses,
    horses_of,
    scratch_dir,
)

AGENT = "agentpool.ops.demo_agents:secretary"
AIM_FOR = 3.0  # seconds a kill waits for a horse inside a tool before it takes any busy horse
TEAMS = ["platform", "billing", "search", "mobile", "infra", "growth", "security", "data", "support", "design"]


class Screen:
    """A live table, redrawn in place on a terminal; off one (a pipe, a log, CI), one line per run
    event instead: a table printed again and again would bury what happened under copies of itself."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.lines = 0
        self.seen: dict[str, str] = {}  # off a terminal: the last event read, per run
        self.held: list[tuple[str, str, dict[str, str]]] = []  # read, not yet printed: (run, event id, event)

    def show(self, r: Redis, run_ids: list[str], note: str, *, final: bool = False) -> None:
        if self.tty:
            self.draw(_table(r, run_ids, note))
            return
        # Every run's events in the order they happened (a stream id is Redis's clock at the write), not
        # run by run, which reads as time going back. An event is printed once Redis's clock has passed
        # its millisecond before the runs were read: none written earlier can turn up in a later look.
        seconds, micros = r.time()
        settled = seconds * 1000 + micros // 1000
        for run_id in run_ids:
            for event_id, event in read_events(r, run_id, after=self.seen.get(run_id, "0-0")):
                self.seen[run_id] = event_id
                self.held.append((run_id, event_id, event))
        self.held.sort(key=lambda row: stream_order(row[1]))
        due = [row for row in self.held if final or stream_order(row[1])[0] < settled]
        self.held = self.held[len(due) :]
        for run_id, event_id, event in due:
            print(_event_line(run_id, event_id, event), flush=True)

    def draw(self, rows: list[str]) -> None:
        if self.lines:
            sys.stdout.write(f"\x1b[{self.lines}F\x1b[J")
        sys.stdout.write("\n".join(rows) + "\n")
        sys.stdout.flush()
        self.lines = len(rows)

    def say(self, text: str) -> None:
        self.lines = 0  # keep the message above the next table
        print(text, flush=True)


def _table(r: Redis, run_ids: list[str], note: str) -> list[str]:
    runs = {run.id: run for run in list_runs(connection=r, limit=len(run_ids) + 50)}
    rows = [f"{'RUN':<26} {'STATUS':<10} {'TURNS':>5} {'TOKENS':>7}  LAST EVENT", "-" * 78]
    for run_id in run_ids:
        run = runs.get(run_id)
        if run is None:
            continue
        events = read_events(r, run_id)
        last = events[-1][1] if events else {}
        detail = last.get("kind", "")
        if last.get("tool"):
            detail += f" {last['tool']}"
        if last.get("kind") == "takeover":
            detail = f"TAKEN OVER ({last.get('cause_kind')})"
        rows.append(f"{run.id:<26} {run.status:<10} {run.turns:>5} {run.total_tokens:>7}  {detail[:40]}")
    rows.append(note)
    return rows


def _event_line(run_id: str, event_id: str, event: dict[str, str]) -> str:
    at = stream_order(event_id)[0] / 1000
    stamp = clock(at, millis=True)
    kind = event.get("kind", "?")
    detail = " ".join(
        f"{k}={v}" for k, v in event.items() if k in ("turn", "tool", "status", "cause_kind", "action", "outcome")
    )
    return f"{stamp} {run_id} {kind:<18} {detail}".rstrip()


def _busy_workers(workers: WorkerProcesses) -> list[tuple[int, list[int]]]:
    """(worker pid, its work horse pids) for workers that are running a turn right now."""
    return [(p.pid, horses) for p in workers.alive() if (horses := horses_of(p.pid))]


def _inside_a_tool(r: Redis, runs: list[Run], workers: WorkerProcesses) -> list[tuple[int, list[int]]]:
    """(worker pid, [the horse]) for each work horse running a tool right now: one of ``runs`` running with
    tool calls pending, whose lease its horse holds (the lease names its holder's pid: worker_identity).
    A kill there always leaves a turn to take over; a horse merely busy may be past its last write."""
    horses = {horse: p.pid for p in workers.alive() for horse in horses_of(p.pid)}
    found = []
    for run in runs:
        if run.status != "running" or not run.pending:
            continue
        token = lease.holder(r, RunKeys.of(run.id)) or ""
        pid = token.rpartition(".")[2]
        if pid.isdigit() and int(pid) in horses:
            found.append((horses[int(pid)], [int(pid)]))
    return found


def _outbox(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@click.command()
@click.option("--runs", "n_runs", type=click.IntRange(1, 200), default=8, show_default=True)
@click.option("--workers", "n_workers", type=click.IntRange(2, 32), default=3, show_default=True)
@click.option("--real", is_flag=True, help="Use the real Anthropic API (needs ANTHROPIC_API_KEY).")
@click.option(
    "--lease-ttl",
    type=float,
    default=5.0,
    show_default=True,
    help="Lease TTL for the demo's workers (production default 15 s).",
)
@click.option("--timeout", type=float, default=180.0, show_default=True)
@click.option(
    "--redis-url",
    default=None,
    help="Use this Redis instead of a throwaway redis-server: an EMPTY database (redis://host:6379/15), "
    "wiped when the demo ends. REDIS_URL is never used: an app's workers there would take the demo's turns.",
)
def demo(n_runs: int, n_workers: int, real: bool, lease_ttl: float, timeout: float, redis_url: str | None) -> None:
    """Run a pool on this machine, kill workers mid-turn, and show nothing is lost or repeated."""
    if real and not os.environ.get("ANTHROPIC_API_KEY"):
        raise click.ClickException("--real needs ANTHROPIC_API_KEY in the environment")
    tmp = scratch_dir("agentpool-demo-")
    screen = Screen()
    redis_server = model = workers = borrowed = None
    try:
        if redis_url:
            borrowed = _borrow(redis_url)
            url = redis_url
            screen.say(f"Redis: {redact_url(url)} (--redis-url; an empty database, wiped at the end)")
        else:
            try:
                redis_server = RedisServer(tmp, durable=True).start()
            except RedisNotInstalled as exc:
                raise click.ClickException(
                    f"{exc}; or pass --redis-url with an empty database the demo may use and wipe"
                ) from None
            url = redis_server.url
            screen.say(f"Redis: throwaway redis-server on {url} (AOF on, noeviction)")
        r = connections.build(url, retry=connections.ride_out())
        env = {
            **os.environ,
            "REDIS_URL": url,
            "AGENTPOOL_LEASE_TTL": str(lease_ttl),
            "AGENTPOOL_REAPER_INTERVAL": "0.5",
            "AGENTPOOL_DEMO_OUTBOX": str(tmp / "outbox.jsonl"),
        }
        env.pop("AGENTPOOL_SHARDS", None)  # as REDIS_URL: an app's shards are never the demo's
        if real:
            screen.say("Model: the real Anthropic API")
        else:
            from agentpool.testing.scripted_model import ScriptedModel

            model = ScriptedModel({"demo": demo_script()}).start()
            env.update(ANTHROPIC_BASE_URL=model.base_url, ANTHROPIC_API_KEY="offline-demo")
            screen.say(f"Model: scripted Messages API on {model.base_url} (offline; --real for the API)")
        workers = WorkerProcesses(env, tmp, cwd=str(tmp))
        workers.start(n_workers, "--log-level", "WARNING")
        screen.say(f"Workers: {n_workers} `agentpool worker` processes; lease TTL {lease_ttl:g} s\n")

        marker = "" if real else " [script:demo]"
        run_ids = [
            enqueue_run(
                AGENT, f"Summarize this week's meeting notes of the {TEAMS[i % len(TEAMS)]} team.{marker}", connection=r
            )
            for i in range(n_runs)
        ]
        crashes = _drive(r, run_ids, workers, screen, timeout)
        _summary(r, run_ids, crashes, tmp / "outbox.jsonl", screen, workers)
    finally:
        if workers:
            workers.stop()
        if model:
            model.stop()
        if redis_server:
            redis_server.stop()
        if borrowed is not None:
            screen.say(f"Cleaned up: {_wipe(borrowed)} keys the demo wrote deleted from {redact_url(redis_url or '')}")
        shutil.rmtree(tmp, ignore_errors=True)


def _borrow(url: str) -> Redis:
    """The database ``--redis-url`` names, if it is empty: the demo deletes everything it wrote there
    afterwards, which is only safe where nothing else was (and where no app's worker waits for turns)."""
    r = quick_client(url, param="redis_url")
    held = r.dbsize()
    if held:
        raise click.ClickException(
            f"the database at {redact_url(url)} holds {held} keys; the demo needs an empty one (it deletes "
            "everything it wrote when it ends, and an app's workers there would take its turns): name another "
            "database (redis://host:6379/15) or leave out --redis-url for a throwaway redis-server"
        )
    return r


def _wipe(r: Redis) -> int:
    """Delete every key of the borrowed database, which was empty when the demo started."""
    deleted = 0
    batch: list[bytes] = []
    for key in r.scan_iter(count=1000):
        batch.append(key)
        if len(batch) == 500:
            deleted += r.unlink(*batch)
            batch.clear()
    if batch:
        deleted += r.unlink(*batch)
    return deleted


def _drive(r: Redis, run_ids: list[str], workers: WorkerProcesses, screen: Screen, timeout: float) -> list[str]:
    """Watch the runs, killing a work horse and then a whole worker once turns are under way."""
    crashes: list[str] = []
    started = time.monotonic()
    note = "waiting for turns to start..."
    plan = [("horse", 1.5), ("worker", 3.5)]
    aiming_since: float | None = None  # when the next kill began to look for a horse inside a tool
    while time.monotonic() - started < timeout:
        runs = [run for run in list_runs(connection=r, limit=len(run_ids) + 50) if run.id in run_ids]
        statuses = {run.id: run.status for run in runs}
        if all(statuses.get(i) not in ACTIVE_STATUSES for i in run_ids):
            screen.show(r, run_ids, note, final=True)
            return crashes
        if not workers.alive():
            raise click.ClickException(
                "every worker exited before the runs finished:\n" + _diagnosis(r, run_ids, workers)
            )
        screen.show(r, run_ids, note)  # what happened so far, before a kill's notice
        if plan and time.monotonic() - started >= plan[0][1]:
            # Aimed at a horse inside a tool; if none is seen while turns are made for a while (counted from
            # the first busy horse: workers slow to start on a loaded machine do not count), at any busy one.
            busy = _inside_a_tool(r, runs, workers)
            where = "inside a tool" if busy else "mid-turn"
            if not busy:
                any_busy = _busy_workers(workers)
                aiming_since = aiming_since or (time.monotonic() if any_busy else None)
                if aiming_since and time.monotonic() - aiming_since >= AIM_FOR:
                    busy = any_busy
            if busy and len(workers.alive()) > 1:
                what, _ = plan.pop(0)
                aiming_since = None
                worker_pid, horses = random.choice(busy)
                if what == "horse":
                    os.kill(horses[0], signal.SIGKILL)
                    note = (
                        f"SIGKILLed work horse {horses[0]} {where} (like the OOM killer); its worker re-enqueues "
                        "the turn at once"
                    )
                else:
                    proc = next(p for p in workers.alive() if p.pid == worker_pid)
                    workers.kill(proc)
                    note = (
                        f"SIGKILLed worker {worker_pid} and its horse {where} (a lost machine); its lease expires "
                        "and a survivor's reaper takes the run over"
                    )
                crashes.append(note)
                screen.say(f"\n*** {note}\n")
        time.sleep(0.25)
    raise click.ClickException(f"runs still active after {timeout:g} s:\n" + _diagnosis(r, run_ids, workers))


def _run_line(r: Redis, run: Run) -> str:
    events = read_events(r, run.id)
    last = events[-1][1] if events else {}
    detail = f": {run.error}" if run.error else f" (last event: {last.get('kind', 'none')})"
    return f"  {run.id} {run.status} after {run.turns} turns{detail}"


def _diagnosis(r: Redis, run_ids: list[str], workers: WorkerProcesses, lines: int = 25) -> str:
    """Which runs did not complete and why, and the end of each worker's log."""
    runs = {run.id: run for run in list_runs(connection=r, limit=len(run_ids) + 50)}
    unfinished = [runs[i] for i in run_ids if i in runs and runs[i].status != "completed"]
    missing = [i for i in run_ids if i not in runs]
    out = [f"{len(unfinished) + len(missing)} of {len(run_ids)} runs did not complete:"]
    out += [_run_line(r, run) for run in unfinished]
    out += [f"  {i}: no longer in Redis (deleted by someone else?)" for i in missing]
    for path in sorted(workers.logdir.glob("worker-*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.stem}'s log, its last {lines} lines at most ---")
        out += tail or ["(empty)"]
    return "\n".join(out)


def _summary(
    r: Redis, run_ids: list[str], crashes: list[str], outbox: Path, screen: Screen, workers: WorkerProcesses
) -> None:
    runs = [run for run in list_runs(connection=r, limit=len(run_ids) + 50) if run.id in set(run_ids)]
    completed = [run for run in runs if run.status == "completed"]
    takeovers = Counter(
        event.get("cause_kind", "?")
        for run_id in run_ids
        for _, event in read_events(r, run_id)
        if event["kind"] == "takeover"
    )
    effects = _outbox(outbox)
    emails = Counter(e["run"] for e in effects if e["kind"] == "email")
    ticket_keys = Counter((e["run"], e["key"]) for e in effects if e["kind"] == "ticket")
    tickets_per_run = Counter(run for run, _key in ticket_keys)
    reads = sum(1 for e in effects if e["kind"] == "read")
    duplicate_emails = sum(1 for n in emails.values() if n > 1)
    extra_tickets = sum(1 for n in tickets_per_run.values() if n > 1)
    screen.say("")
    screen.say("Summary")
    screen.say(f"  runs completed:      {len(completed)}/{len(run_ids)}")
    screen.say(
        f"  turns:               {sum(run.turns for run in runs)} (tokens {sum(run.total_tokens for run in runs)})"
    )
    screen.say(
        f"  crashes survived:    {len(crashes)} kills, {sum(takeovers.values())} turns taken over "
        f"({', '.join(f'{k}: {v}' for k, v in sorted(takeovers.items())) or 'none'})"
    )
    screen.say(f"  emails sent:         {sum(emails.values())} for {len(emails)} runs, duplicates: {duplicate_emails}")
    screen.say(
        f"  tickets opened:      {sum(ticket_keys.values())} executions, {len(ticket_keys)} distinct keys, "
        f"runs with two tickets: {extra_tickets}"
    )
    screen.say(f"  notes read:          {reads} (read tools may re-run after a crash)")
    unknown = [
        run.id
        for run in runs
        for m in run.messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("is_error") and "unknown" in str(b.get("content"))
    ]
    if unknown:
        screen.say(f"  emails whose outcome was unknown after a crash, reported to the model: {len(unknown)}")
    if len(completed) == len(run_ids) and not duplicate_emails and not extra_tickets:
        screen.say("\nEvery run finished; every side effect happened at most once.")
        return
    problems = []
    if duplicate_emails:
        problems.append("emails sent twice, for runs " + ", ".join(run for run, n in emails.items() if n > 1))
    if extra_tickets:
        problems.append("two tickets opened, for runs " + ", ".join(run for run, n in tickets_per_run.items() if n > 1))
    report = "\n".join(problems + ([_diagnosis(r, run_ids, workers)] if len(completed) < len(run_ids) else []))
    raise click.ClickException("the demo did not go as it should:\n" + report)
