"""The ``agentpool`` command."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING

import click

from agentpool.runtime.settings import Settings, connect, redact_url
from agentpool.store import ledger
from agentpool.store.errors import AgentPoolError
from agentpool.store.keys import RunKeys

if TYPE_CHECKING:
    from agentpool.client import Run

url_option = click.option("--url", "-u", envvar="REDIS_URL", default=None, help="Redis URL (env REDIS_URL).")


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


@click.group()
def main() -> None:
    """agentpool: durable Claude agent runs on a pool of RQ workers."""


@main.command()
@url_option
@click.option("--name", default=None, help="Worker name (default: random).")
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    help="INFO adds RQ's job lines and one structured line per run event.",
)
@click.option("--no-scheduler", is_flag=True, help="Do not run RQ's scheduler (deferred retries need one somewhere).")
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Turns in flight at once in this process (threads); 1 forks a work horse per turn, as RQ does.",
)
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
def worker(
    url: str | None,
    name: str | None,
    burst: bool,
    log_level: str,
    no_scheduler: bool,
    concurrency: int,
    metrics_port: int | None,
) -> None:
    """Run an RQ worker for agent turns."""
    from rq.logutils import setup_loghandlers

    # agentpool's own lines (events at INFO, takeovers, lost leases) beside RQ's, named by their logger.
    setup_loghandlers(log_level.upper(), name="agentpool", log_format="%(asctime)s %(name)s: %(message)s")
    # A threaded worker's turns, RQ's heartbeat thread, the lease keeper and the reaper share its pool.
    r = connect(url, max_connections=2 * concurrency + 16 if concurrency > 1 else None)
    click.echo(f"agentpool worker on {redact_url(url or Settings.from_env().redis_url)}", err=True)
    if metrics_port:
        from agentpool.ops.metrics import start_metrics_server

        start_metrics_server(metrics_port, r)
    if concurrency > 1:
        from agentpool.worker.supervisor import run_threaded_worker

        run_threaded_worker(
            r,
            name=name,
            concurrency=concurrency,
            burst=burst,
            logging_level=log_level.upper(),
            with_scheduler=not no_scheduler,
        )
        return
    from agentpool.worker.forking import AgentWorker

    AgentWorker(connection=r, name=name).work(
        burst=burst, logging_level=log_level.upper(), with_scheduler=not no_scheduler
    )


@main.command()
@url_option
@click.argument("agent")
@click.argument("task")
@click.option("--max-turns", type=int, default=None)
@click.option("--wait", is_flag=True, help="Wait for the run to end and print its result.")
@click.option("--timeout", type=float, default=600.0, show_default=True)
def enqueue(url: str | None, agent: str, task: str, max_turns: int | None, wait: bool, timeout: float) -> None:
    """Enqueue a run of AGENT (module:attribute) on TASK; print its id."""
    from agentpool.client import enqueue_run, wait_for_run

    r = connect(url)
    try:
        run_id = enqueue_run(agent, task, connection=r, max_turns=max_turns)
    except ValueError as exc:
        _fail(str(exc))
    click.echo(run_id)
    if wait:
        run = wait_for_run(run_id, timeout=timeout, connection=r)
        click.echo(f"{run.status} after {run.turns} turns: {run.result or run.error or ''}")
        sys.exit(0 if run.status == "completed" else 1)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@main.command()
@url_option
@click.option("--status", default=None, help="Only runs with this status.")
@click.option("--agent", default=None, help="Only runs of this agent.")
@click.option("--limit", type=int, default=50, show_default=True)
def runs(url: str | None, status: str | None, agent: str | None, limit: int) -> None:
    """A table of runs, newest first."""
    from agentpool.client import list_runs

    rows = list_runs(connection=connect(url), limit=limit, status=status, agent=agent)
    click.echo(f"{'ID':<28} {'AGENT':<32} {'STATUS':<17} {'TURNS':>5} {'TOKENS':>9} {'AGE':>5}  NOTE")
    now = time.time()
    for run in rows:
        click.echo(
            f"{run.id:<28} {run.agent[:32]:<32} {run.status:<17} {run.turns:>5} {run.total_tokens:>9} "
            f"{_age(now - run.created_at):>5}  {_short_note(run, now)}".rstrip()
        )


def _short_note(run: Run, now: float) -> str:
    """Why a queued or running run is not moving, in a few words (``show`` gives the whole story)."""
    waiting = run.waiting or {}
    kind = waiting.get("kind")
    if kind == "handed_back":
        return f"handed back ({waiting['reason']}) since {_age(now - waiting['since'])}: {waiting['detail']}"[:120]
    if kind == "backoff":
        return f"backoff after {waiting['detail']}"[:80] + (
            f", retry in {_age(max(0.0, waiting['until'] - now))}" if waiting.get("until") else ""
        )
    if kind == "queued":
        return "waiting for a worker" + (f" for {_age(now - waiting['since'])}" if waiting.get("since") else "")
    if kind == "lost":
        return waiting["note"]
    return (run.error or "")[:80] if run.status not in ("completed", "running", "queued") else ""


@main.command()
@url_option
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
def show(url: str | None, run_id: str, as_json: bool) -> None:
    """A run's header, conversation, pending tool_uses and ledger."""
    from agentpool.client import get_run

    r = connect(url)
    try:
        run = get_run(run_id, connection=r)
        entries = ledger.read_all(r, RunKeys.of(run_id))
    except AgentPoolError as exc:
        _fail(str(exc))
    if as_json:
        doc = run.to_dict()
        doc["ledger"] = entries
        click.echo(json.dumps(doc, ensure_ascii=False, default=str))
        return
    click.echo(f"run {run.id}  agent {run.agent}  status {run.status}  turns {run.turns}")
    click.echo("usage " + ", ".join(f"{k}={v}" for k, v in run.usage.items()))
    if run.waiting:
        click.echo(f"now: {run.waiting['note']}")
    if run.error:
        click.echo(f"error: {run.error}")
    if run.result:
        click.echo(f"result: {run.result}")
    click.echo("")
    for n, message in enumerate(run.messages):
        click.echo(f"[{n}] {message['role']}")
        for line in _describe(message["content"]):
            click.echo(f"    {line}")
    if run.status == "waiting_approval":
        click.echo(f"\nwaiting for a decision: agentpool approve {run.id} [TOOL_USE_ID] [--deny --reason TEXT]")
    if run.pending:
        click.echo("\npending:")
        for call in run.pending:
            click.echo(f"    {call['id']} {call['name']} {json.dumps(call['input'])[:200]}")
    if entries:
        click.echo("\nledger:")
        for tool_use_id, entry in entries.items():
            intent, outcome = entry.get("intent", {}), entry.get("outcome")
            state = (
                f"done ({outcome['how']}{', error' if outcome['is_error'] else ''})"
                if outcome
                else "started, no outcome"
            )
            click.echo(
                f"    {tool_use_id} {intent.get('name', '?')} [{intent.get('effect', '?')}] attempts={intent.get('attempt', 0)} {state}"
            )


def _describe(content: object) -> list[str]:
    if isinstance(content, str):
        return [content[:300]]
    lines = []
    for block in content:  # type: ignore[union-attr]
        kind = block.get("type")
        if kind == "text":
            lines.append(block["text"][:300])
        elif kind == "tool_use":
            lines.append(f"-> {block['name']}({json.dumps(block.get('input'))[:200]})  [{block['id']}]")
        elif kind == "tool_result":
            body = block.get("content")
            body = body if isinstance(body, str) else json.dumps(body)
            lines.append(f"<- {'ERROR ' if block.get('is_error') else ''}{body[:200]}  [{block['tool_use_id']}]")
        else:
            lines.append(f"({kind})")
    return lines


@main.command()
@url_option
@click.argument("run_id")
def cancel(url: str | None, run_id: str) -> None:
    """End a run for good."""
    from agentpool.client import cancel_run

    try:
        before = cancel_run(run_id, connection=connect(url))
    except AgentPoolError as exc:
        _fail(str(exc))
    click.echo(
        f"{run_id}: was {before}; "
        + ("cancelled" if before not in ("completed", "failed", "cancelled") else "unchanged")
    )


@main.command()
@url_option
@click.argument("run_id")
@click.argument("tool_use_id", required=False)
@click.option("--deny", is_flag=True, help="Refuse the call(s): the model gets an is_error result with the reason.")
@click.option("--reason", default=None, help="Why; passed to the model on a denial.")
def approve(url: str | None, run_id: str, tool_use_id: str | None, deny: bool, reason: str | None) -> None:
    """Approve (or --deny) a call RUN_ID waits on; without TOOL_USE_ID, every call it waits on."""
    from agentpool.client import approve as decide

    try:
        decided = decide(run_id, tool_use_id, approved=not deny, reason=reason, connection=connect(url))
    except AgentPoolError as exc:
        _fail(str(exc))
    click.echo(f"{'denied' if deny else 'approved'}: {', '.join(decided)}")


@main.command()
@url_option
@click.argument("run_id")
@click.option("--add-turns", type=click.IntRange(min=0), default=0)
@click.option("--add-tokens", type=click.IntRange(min=0), default=0)
@click.option("--add-usd", type=click.FloatRange(min=0), default=0.0)
def resume(url: str | None, run_id: str, add_turns: int, add_tokens: int, add_usd: float) -> None:
    """Continue a stopped run from its checkpoint, raising its limits."""
    from agentpool.client import resume as resume_run

    try:
        run = resume_run(run_id, add_turns=add_turns, add_tokens=add_tokens, add_usd=add_usd, connection=connect(url))
    except AgentPoolError as exc:
        _fail(str(exc))
    click.echo(f"{run_id}: {run.status} at turn {run.turns}")


@main.command()
@url_option
@click.argument("run_id")
def watch(url: str | None, run_id: str) -> None:
    """Follow a run live: turns, tokens, the tool in flight, status. Exits when the run ends."""
    from agentpool.runtime.progress import why_waiting
    from agentpool.store import checkpoint
    from agentpool.store.events import read as read_events

    r = connect(url)
    try:
        state = checkpoint.load_run(r, run_id, with_messages=False)
    except AgentPoolError as exc:
        _fail(str(exc))
    click.echo(f"run {run_id} ({state.agent}): {state.status}, turn {state.turns}, {sum(state.usage.values())} tokens")
    last = "0-0"
    said = ""
    while True:
        for event_id, event in read_events(r, run_id, after=last, block_ms=1000):
            last = event_id
            click.echo(_event_line(event))
        state = checkpoint.load_run(r, run_id, with_messages=False)
        waiting = why_waiting(r, run_id, state.status)
        if waiting and waiting.kind != "in_progress" and waiting.note != said:
            click.echo(f"{time.strftime('%H:%M:%S')} {'waiting':<18} {waiting.note}")
        said = waiting.note if waiting else ""
        if state.status in ("completed", "failed", "cancelled", "stopped"):
            for event_id, event in read_events(r, run_id, after=last):
                click.echo(_event_line(event))
            click.echo(
                f"run {run_id} {state.status} after {state.turns} turns, {sum(state.usage.values())} tokens"
                + (f": {state.error}" if state.error else "")
            )
            return


def _event_line(event: dict[str, str]) -> str:
    kind = event.pop("kind", "?")
    detail = " ".join(f"{k}={v}" for k, v in event.items())
    return f"{time.strftime('%H:%M:%S')} {kind:<18} {detail}"


@main.command()
@url_option
@click.option("--interval", type=float, default=1.0, show_default=True)
@click.option("--once", is_flag=True, help="Scan once and exit.")
def reap(url: str | None, interval: float, once: bool) -> None:
    """Re-enqueue turns whose worker died (the reaper every worker also runs)."""
    from agentpool.runtime.reaper import reap_once

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    r = connect(url)
    while True:
        for run_id in reap_once(r):
            click.echo(f"re-enqueued {run_id}")
        if once:
            return
        time.sleep(interval)


@main.command()
def genkey() -> None:
    """Print a new key for AGENTPOOL_ENCRYPTION_KEY (encryption at rest)."""
    from agentpool.store.crypto import generate_key

    click.echo(generate_key())


@main.command()
@url_option
def check(url: str | None) -> None:
    """Exit 0 if Redis answers within 2 s (for liveness/readiness probes), non-zero otherwise."""
    from redis import Redis
    from redis.exceptions import RedisError

    client = Redis.from_url(url or Settings.from_env().redis_url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except RedisError as exc:
        _fail(f"Redis unreachable at {redact_url(url or Settings.from_env().redis_url)}: {exc}")
    finally:
        client.close()
    click.echo("ok")


def _add_ops_commands() -> None:
    # The servers and the lab (dashboard, metrics, demo, bench) each live in a module of their own.
    from agentpool.ops.bench import bench
    from agentpool.ops.dashboard import dashboard
    from agentpool.ops.demo import demo
    from agentpool.ops.metrics import metrics

    for command in (bench, dashboard, demo, metrics):
        main.add_command(command)


_add_ops_commands()

if __name__ == "__main__":
    main()
