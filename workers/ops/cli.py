"""The ``agentpool`` command."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from importlib import import_module
from typing import TYPE_CHECKING, Any, ClassVar

import click

from agentpool.checks import InvalidLimit, limit_value, optional_actor
from agentpool.ops.redisconn import (
    OneLineErrors,
    describe,
    pool_client,
    quick_client,
    shard_target,
    shard_urls,
    target_url,
)
from agentpool.runtime.settings import connect, redact_url
from agentpool.runtime.shards import each, each_answering, located, route
from agentpool.store import ledger
from agentpool.store.errors import AgentPoolError, RedisUnreachable
from agentpool.store.keys import RunKeys
from agentpool.store.records import STATUSES, tool_uses

if TYPE_CHECKING:
    from collections.abc import Callable

    from redis import Redis

    from agentpool.client import Run
    from agentpool.runtime.shards import Shards

url_option = click.option("--url", "-u", envvar="REDIS_URL", default=None, help="Redis URL (env REDIS_URL).")


def _actor(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    try:
        return optional_actor(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def by_option(what: str, default: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--by NAME``: who acts (alice, ops-bot@example.com), checked before anything is done; ``what``
    says where the name is kept."""
    return click.option(
        "--by", default=default, show_default=default is not None, callback=_actor, help=f"Who acts: {what} keeps it."
    )


class LimitParam(click.ParamType):
    """A limit or an amount to add, checked by ``agentpool.checks.limit_value`` as the API checks it
    (click's own ``FloatRange`` lets ``nan`` through)."""

    def __init__(self, *, whole: bool, zero_ok: bool = False) -> None:
        self.whole, self.zero_ok = whole, zero_ok
        self.name = "integer" if whole else "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            try:
                value = int(value) if self.whole and value.strip().lstrip("+-").isdigit() else float(value)
            except ValueError:
                self.fail(f"{value!r} is not a number", param, ctx)
        try:
            return limit_value(
                (param.name if param else None) or "value", value, whole=self.whole, zero_ok=self.zero_ok
            )
        except InvalidLimit as exc:
            self.fail(str(exc), param, ctx)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _refuse(exc: Exception) -> None:
    """A command's error in one line; Redis out of reach is left to the group, which says where."""
    if isinstance(exc, RedisUnreachable):
        raise exc
    _fail(str(exc))


class _Commands(OneLineErrors):
    """The servers and the lab (dashboard, metrics, demo, bench) each live in a module of their own,
    imported only when its command is named: ``agentpool runs`` must not load the dashboard's web
    stack, Prometheus's client or the bench's testing kit."""

    LAZY: ClassVar[dict[str, str]] = {
        "bench": "agentpool.ops.bench",
        "dashboard": "agentpool.ops.dashboard",
        "demo": "agentpool.ops.demo",
        "limits": "agentpool.ops.limits",
        "metrics": "agentpool.ops.metrics",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY and cmd_name not in self.commands:
            self.add_command(getattr(import_module(self.LAZY[cmd_name]), cmd_name))
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Commands)
def main() -> None:
    """agentpool: durable Claude agent runs on a pool of RQ workers."""


@main.command()
@url_option
@click.argument("queues", nargs=-1)
@click.option("--name", default=None, help="Worker name (default: random).")
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    help="INFO adds RQ's job lines and one structured line per run event.",
)
@click.option(
    "--no-scheduler",
    is_flag=True,
    hidden=False,
    help="Accepted and ignored: no worker runs RQ's scheduler any more (the reaper enqueues deferred turns).",
)
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Turns in flight at once in this process (threads); 1 forks a work horse per turn, as RQ does.",
)
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address --metrics-port binds (0.0.0.0 for a Prometheus on another machine).",
)
@click.option(
    "--shard",
    "shard_picks",
    multiple=True,
    help="On a sharded pool (AGENTPOOL_SHARDS): a shard to serve, by its number, or all (repeatable; "
    "default all). Several shards are served by a worker process each, under this one.",
)
def worker(
    url: str | None,
    queues: tuple[str, ...],
    name: str | None,
    burst: bool,
    log_level: str,
    no_scheduler: bool,  # kept so that existing command lines still start
    concurrency: int,
    metrics_port: int | None,
    metrics_host: str,
    shard_picks: tuple[str, ...],
) -> None:
    """Run an RQ worker for agent turns, serving QUEUES in order (default: the queue default alone):
    ``agentpool worker urgent default`` takes an urgent turn before any default one. On a sharded pool
    (AGENTPOOL_SHARDS) it serves every shard, or those given with --shard."""
    from rq.logutils import setup_loghandlers

    from agentpool.runtime.settings import Settings
    from agentpool.store.keys import DEFAULT_QUEUE, check_queue, rq_queue_name

    # A bad AGENTPOOL_* setting (a rate limit, a timeout, a webhook URL) or a pool default webhook without
    # its signing secret says so in one line, now.
    Settings.from_env().check_worker()
    # `kill -USR2 <pid>` writes every thread's stack to this process's stderr (inherited by the processes
    # it forks): where a worker that takes no turns is waiting, without stopping it.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
        rq_queues = [rq_queue_name(check_queue(q)) for q in dict.fromkeys(queues or (DEFAULT_QUEUE,))]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="QUEUES") from None
    # agentpool's own lines (events at INFO, takeovers, lost leases) beside RQ's, named by their logger.
    setup_loghandlers(log_level.upper(), name="agentpool", log_format="%(asctime)s %(name)s: %(message)s")
    served, urls = _shards_served(url, shard_picks)
    if len(served) > 1:
        _serve_shards(url, urls, served, queues, name, burst, log_level, concurrency, metrics_port, metrics_host)
        return
    if served:
        from agentpool.worker.spread import adopted

        adopted()  # started by a worker serving several shards: end with it
        target = shard_target(served[0], urls[served[0]])
        os.environ["REDIS_URL"] = target  # what this process and the ones it starts connect to
    else:
        target = target_url(url)
    # A threaded worker's turns, RQ's heartbeat thread, the lease keeper and the reaper share its pool.
    r = connect(target, max_connections=2 * concurrency + 16 if concurrency > 1 else None)
    which = f" (shard {served[0]} of {len(urls)})" if served else ""
    click.echo(f"agentpool worker on {redact_url(target)}{which}", err=True)
    # Say now, in one line, if Redis cannot be reached: at once for a burst worker (a script waits on
    # it), after riding out a restart (the client's ~15 s of retries) for a long-lived one.
    (quick_client(target) if burst else r).ping()
    from agentpool.runtime import durability

    # Decided once, before any turn is forked or threaded: every turn of this worker uses the same guard.
    click.echo(f"durability guard: {durability.guard(r).describe()}", err=True)
    from agentpool.runtime.redis_checks import hazards

    for hazard in hazards(r):
        click.echo(f"warning: {hazard}", err=True)
    if metrics_port:
        from agentpool.ops.metrics import scrape_client, start_metrics_server

        try:
            # Its own client: a scrape must answer quickly while Redis hangs, not retry as a turn does.
            start_metrics_server(metrics_port, scrape_client(url), host=metrics_host)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {metrics_host}:{metrics_port}: {exc}") from None
    if concurrency > 1:
        from agentpool.worker.supervisor import run_threaded_worker

        run_threaded_worker(
            r,
            name=name,
            concurrency=concurrency,
            burst=burst,
            logging_level=log_level.upper(),
            queues=rq_queues,
        )
        return
    from agentpool.worker.forking import AgentWorker

    # No RQ scheduler: deferred turns are agentpool's own (agentpool.runtime.deferred), so nothing this
    # worker starts can outlive it holding a lock the pool waits on.
    AgentWorker(rq_queues, connection=r, name=name).work(
        burst=burst, logging_level=log_level.upper(), with_scheduler=False
    )


def _shards_served(url: str | None, picks: tuple[str, ...]) -> tuple[list[int], tuple[str, ...]]:
    """The shards this worker serves (none: not a sharded pool, or --url given) and every shard's URL."""
    urls = shard_urls(url)
    if not urls:
        if picks:
            raise click.UsageError("--shard needs AGENTPOOL_SHARDS (the shards' Redis URLs), and no --url")
        return [], ()
    if not picks or "all" in picks:
        return list(range(len(urls))), urls
    chosen = []
    for pick in picks:
        if not pick.isdigit() or int(pick) >= len(urls):
            raise click.BadParameter(
                f"{pick!r}: {len(urls)} shards are listed in AGENTPOOL_SHARDS, 0 to {len(urls) - 1} (or all)",
                param_hint="--shard",
            )
        chosen.append(int(pick))
    return list(dict.fromkeys(chosen)), urls


def _serve_shards(
    url: str | None,
    urls: tuple[str, ...],
    served: list[int],
    queues: tuple[str, ...],
    name: str | None,
    burst: bool,
    log_level: str,
    concurrency: int,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """A worker process per shard (``agentpool.worker.spread``), this one watching them."""
    from agentpool.worker.spread import ShardWorkers

    if metrics_port:
        from agentpool.ops.metrics import scrape_client, start_metrics_server

        try:
            start_metrics_server(metrics_port, scrape_client(url), host=metrics_host)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {metrics_host}:{metrics_port}: {exc}") from None
    click.echo(f"agentpool worker on shards {', '.join(map(str, served))} of {len(urls)}: a process each", err=True)
    args = ["--log-level", log_level, "--concurrency", str(concurrency), *(["--burst"] if burst else []), *queues]
    code = ShardWorkers({shard: urls[shard] for shard in served}, args, burst=burst, name=name).run()
    if code:
        sys.exit(code)


@main.command()
@url_option
@click.argument("agent")
@click.argument("task")
@click.option("--max-turns", type=LimitParam(whole=True), default=None, help="Overrides the agent's max_turns.")
@click.option(
    "--max-total-tokens", type=LimitParam(whole=True), default=None, help="Overrides the agent's max_total_tokens."
)
@click.option("--max-cost-usd", type=LimitParam(whole=False), default=None, help="Overrides the agent's max_cost_usd.")
@click.option("--queue", default="default", show_default=True, help="The queue every turn of the run goes to.")
@click.option(
    "--webhook",
    default=None,
    metavar="URL",
    help="POST the run's signed summary to this http(s) URL when it ends (see agentpool.webhooks).",
)
@click.option(
    "--webhook-event",
    "webhook_events",
    type=click.Choice(["ended", "waiting_approval"]),
    multiple=True,
    help="What --webhook is told (repeatable): ended (default), waiting_approval.",
)
@click.option("--wait", is_flag=True, help="Wait for the run to end and print its result.")
@click.option("--timeout", type=LimitParam(whole=False), default=None, help="Seconds to --wait (default 600).")
@click.option(
    "--no-check-agent",
    "no_check_agent",
    is_flag=True,
    help="Do not load AGENT here first (for a machine without the agents' code; workers load it).",
)
def enqueue(
    url: str | None,
    agent: str,
    task: str,
    max_turns: int | None,
    max_total_tokens: int | None,
    max_cost_usd: float | None,
    queue: str,
    webhook: str | None,
    webhook_events: tuple[str, ...],
    wait: bool,
    timeout: float | None,
    no_check_agent: bool,
) -> None:
    """Enqueue a run of AGENT (module:attribute) on TASK; print its id. AGENT is loaded here first, as
    a worker will load it (from the current directory): a typo is an error now, not a stuck run."""
    from agentpool.client import enqueue_run, wait_for_run

    _timeout_needs_wait(timeout, wait)
    if "" not in sys.path:  # the agent is looked for where `agentpool worker` looks: the current directory
        sys.path.insert(0, "")
    r = pool_client(url)
    try:
        run_id = enqueue_run(
            agent,
            task,
            connection=r,
            max_turns=max_turns,
            max_total_tokens=max_total_tokens,
            max_cost_usd=max_cost_usd,
            check_agent=not no_check_agent,
            queue=queue,
            webhook=webhook,
            webhook_events=webhook_events or ("ended",),
        )
    except ValueError as exc:
        _refuse(exc)
    click.echo(run_id)
    if wait:
        run = wait_for_run(run_id, timeout=timeout or WAIT_TIMEOUT, connection=r)
        click.echo(f"{run.status} after {run.turns} turns: {run.result or run.error or ''}")
        sys.exit(0 if run.status == "completed" else 1)


WAIT_TIMEOUT = 600.0


def _timeout_needs_wait(timeout: float | None, wait: bool) -> None:
    if timeout is not None and not wait:
        raise click.UsageError("--timeout is how long --wait waits; add --wait, or drop --timeout")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@main.command()
@url_option
@click.option(
    "--status",
    type=click.Choice(sorted(STATUSES | {"unreadable"})),
    default=None,
    help="Only runs with this status (unreadable: the runs this agentpool cannot decode).",
)
@click.option(
    "--agent",
    default=None,
    help="Only runs of this agent: its full path (myapp.agents:refunds), its name (refunds) or its module (myapp.agents).",
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="Show at most this many runs.")
def runs(url: str | None, status: str | None, agent: str | None, limit: int) -> None:
    """A table of runs, newest first."""
    from agentpool.client import list_runs, newest_first
    from agentpool.runtime import deferred

    r = pool_client(url)
    pages, unavailable = each_answering(r, lambda c: list_runs(connection=c, limit=limit, status=status, agent=agent))
    rows = newest_first([page for _shard, page in pages], limit)  # over every shard that answered
    click.echo(
        f"{'ID':<28} {'AGENT':<32} {'QUEUE':<10} {'STATUS':<17} {'TURNS':>5} {'TOKENS':>9} {'COST':>9} {'AGE':>5}  NOTE"
    )
    now = time.time()
    for run in rows:
        click.echo(
            f"{run.id:<28} {run.agent[:32]:<32} {run.queue[:10]:<10} {run.status:<17} {run.turns:>5} {run.total_tokens:>9} "
            f"{'$' + format(run.cost_usd, '.4f'):>9} {_age(now - run.created_at):>5}  {_short_note(run, now)}".rstrip()
        )
    summaries = [summary for _shard, summary in each_answering(r, deferred.summary)[0]]
    count, overdue = sum(n for n, _ in summaries), max((late for _, late in summaries), default=0.0)
    if count:  # not RQ jobs until due, so `rq info` does not count them
        late = f"; the oldest due one is {overdue:.0f} s overdue: is any worker running?" if overdue > 2 else ""
        click.echo(
            f"\n{count} turn(s) deferred (after model errors, or waiting for a rate-limit budget), "
            f"enqueued by the reaper when due{late}"
        )
    if unavailable:  # the other shards' runs are above; a script reading them learns the list is partial
        for missing in unavailable:
            click.echo(f"error: not listed, did not answer: {missing}", err=True)
        sys.exit(1)


def _tree_lines(nodes: list[dict[str, Any]], level: int) -> list[str]:
    """One line per child run, indented by depth: its full id (ids made together share a prefix), status, cost."""
    lines = []
    for node in nodes:
        cost = f"${node['cost_usd']:.4f}" if "cost_usd" in node else ""
        held = f"  (held by the budget of {node['held_by']})" if node.get("held_by") else ""
        lines.append(f"{'    ' * level}{node['id']}  {node['status']}  {node.get('agent', '')}  {cost}{held}".rstrip())
        lines += _tree_lines(node["children"], level + 1)
    return lines


def _short_note(run: Run, now: float) -> str:
    """Why a queued or running run is not moving, in a few words (``show`` gives the whole story)."""
    if run.status == "unreadable":  # the whole error is `agentpool show RUN_ID`'s, without the run's id
        why = (run.error or "").removeprefix(f"run {run.id}").lstrip(": ")
        return f"cannot read it here: {why}"[:120]
    waiting = run.waiting or {}
    kind = waiting.get("kind")
    if kind == "handed_back" and waiting["reason"] == "agent_not_loadable":
        since = _age(now - waiting["since"])
        return f"waiting for a worker that can load its agent (handed back since {since}): {waiting['detail']}"[:140]
    if kind == "handed_back":
        return f"handed back ({waiting['reason']}) since {_age(now - waiting['since'])}: {waiting['detail']}"[:120]
    if kind == "waiting_for_replica":
        return f"waiting for a replica to acknowledge for {_age(now - waiting['since'])}"
    if kind == "backoff":
        return f"backoff after {waiting['detail']}"[:80] + (
            f", retry in {_age(max(0.0, waiting['until'] - now))}" if waiting.get("until") else ""
        )
    if kind == "queued":
        return "waiting for a worker" + (f" for {_age(now - waiting['since'])}" if waiting.get("since") else "")
    if kind == "lost":
        return waiting["note"]
    if run.status == "waiting_approval":
        return f"waiting for a person's decision: agentpool approve {run.id} [--deny]"
    if run.status == "waiting_children":
        return "waiting for its child runs (agentpool show lists them)"
    return (run.error or "")[:80] if run.status not in ("completed", "running", "queued") else ""


@main.command()
@url_option
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
def show(url: str | None, run_id: str, as_json: bool) -> None:
    """A run's header, its child runs, conversation, pending tool_uses and ledger."""
    from agentpool.client import get_run, run_tree

    r, shard = located(pool_client(url), run_id)  # on a sharded pool, the shard holding it
    try:
        run = get_run(run_id, connection=r)
        entries = _in_call_order(run.messages, ledger.read_all(r, RunKeys.of(run_id)))
    except AgentPoolError as exc:
        _refuse(exc)
    if as_json:
        doc = run.to_dict()
        doc["ledger"] = entries
        if shard is not None:
            doc["shard"] = shard
        click.echo(json.dumps(doc, ensure_ascii=False, default=str))
        return
    click.echo(
        f"run {run.id}  agent {run.agent}  queue {run.queue}  status {run.status}  turns {run.turns}  "
        f"tokens {run.total_tokens}  cost ${run.cost_usd:.4f}" + (f"  shard {shard}" if shard is not None else "")
    )
    click.echo("usage " + ", ".join(f"{k}={v}" for k, v in run.usage.items()))
    if run.parent or run.children:
        click.echo(
            "own usage (without child runs) "
            + ", ".join(f"{k}={v}" for k, v in run.own_usage.items())
            + f"  own cost ${run.own_cost_usd:.4f}"
        )
    if run.parent:
        click.echo(f"child of {run.parent} (depth {run.depth})")
    if run.children:
        click.echo("child runs:")
        for line in _tree_lines(run_tree(run.id, connection=r)["children"], 1):
            click.echo(line)
    if run.forked_from:
        click.echo(f"forked from {run.forked_from} at turn {run.forked_at}")
    if run.waiting:
        click.echo(f"now: {run.waiting['note']}")
    if run.error:
        click.echo(f"error: {run.error}")
    if run.result:
        click.echo(f"result: {run.result}")
    click.echo("")
    for n, message in enumerate(run.messages):
        if n == run.window_start and n:
            click.echo("--- compacted: the next request starts here; what is above is summarized ---")
        click.echo(f"[{n}] {message['role']}")
        for line in _describe(message["content"]):
            click.echo(f"    {line}")
    if run.inbox:
        click.echo("\nmessages waiting for delivery at the next turn boundary:")
        for sent in run.inbox:
            click.echo(f"    {sent['id']}: {_clip(' '.join(_describe(sent['content'])), 200)}")
    if run.status == "waiting_approval":
        click.echo(f"\nwaiting for a decision: agentpool approve {run.id} TOOL_USE_ID [--deny --reason TEXT]")
    if run.webhooks:
        click.echo("\nwebhooks:")
        for line in _webhook_lines(run.webhooks):
            click.echo(f"    {line}")
    if run.pending:
        click.echo("\npending:")
        for call in run.pending:
            click.echo(f"    {call['id']} {call['name']} {json.dumps(call['input'])}")  # whole: it is decided on
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
                f"    {tool_use_id} {intent.get('name') or (outcome or {}).get('name', '?')} "
                f"[{intent.get('effect', 'not run' if outcome else '?')}] attempts={intent.get('attempt', 0)} {state}"
            )


def _webhook_lines(deliveries: list[dict[str, Any]]) -> list[str]:
    """One line per webhook delivery: what it reports, where it goes, and how it stands."""
    from agentpool.webhooks import shown_url

    now = time.time()
    lines = []
    for d in deliveries:
        where = shown_url(d["url"])
        tries = f"{d['attempts']} attempt{'s' if d['attempts'] != 1 else ''}"
        if d["state"] == "delivered":
            state = f"delivered ({tries})"
        elif d["state"] == "undelivered":
            state = f"UNDELIVERED, given up after {tries}; last error: {d['error']}"
        else:
            state = f"pending ({tries}"
            if d["next_at"]:
                state += f", next try in {max(0.0, d['next_at'] - now):.0f} s"
            state += f"; last error: {d['error']})" if d["error"] else ")"
            if d["waiting"]:
                state += f": {d['waiting']}"
        lines.append(f"{d['id']} {d['event']} ({d['status']}) -> {where}: {state}")
    return lines


def _in_call_order(messages: list[dict[str, Any]], entries: dict[str, Any]) -> dict[str, Any]:
    """The ledger in the order the model asked for the calls (a hash has no order of its own)."""
    order = [block["id"] for block in tool_uses(messages)]
    rank = {tool_use_id: n for n, tool_use_id in enumerate(order)}
    return dict(sorted(entries.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def _clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters for a line of ``show``, saying so: a line that ends midway
    without a mark reads as whole (``show --json`` has everything)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def _describe(content: object) -> list[str]:
    """A message's lines for ``show``. Whatever the content holds is printed somehow: ``show`` is what a
    person runs to look at a damaged run, so it must not fail on the damage (records.unpack_message
    checks the shapes a run's messages have; an inbox message, for one, comes from elsewhere)."""
    if isinstance(content, str):
        return [_clip(content, 300)]
    if not isinstance(content, list):
        return [f"(unexpected content: {_clip(repr(content), 200)})"]
    lines = []
    for block in content:
        if not isinstance(block, dict):
            lines.append(f"(unexpected block: {_clip(repr(block), 200)})")
            continue
        kind = block.get("type")
        if kind == "text":
            lines.append(_clip(str(block.get("text")), 300))
        elif kind == "tool_use":
            lines.append(
                f"-> {block.get('name', '?')}({_clip(json.dumps(block.get('input'), default=str), 200)})"
                f"  [{block.get('id', '?')}]"
            )
        elif kind == "compaction":
            lines.append(f"[compaction] {_clip(str(block.get('content') or '(failed)'), 300)}")
        elif kind == "tool_result":
            body = block.get("content")
            body = body if isinstance(body, str) else json.dumps(body, default=str)
            lines.append(
                f"<- {'ERROR ' if block.get('is_error') else ''}{_clip(body, 200)}  [{block.get('tool_use_id', '?')}]"
            )
        else:
            lines.append(f"({kind})")
    return lines


@main.command()
@url_option
@click.argument("run_id")
@click.option("--reason", default=None, help="The run's error (default: cancelled by request, or by --by).")
@by_option("the run's status event (and its child runs')")
def cancel(url: str | None, run_id: str, reason: str | None, by: str | None) -> None:
    """End a run for good."""
    from agentpool.client import cancel_run

    try:
        before = cancel_run(run_id, connection=pool_client(url), reason=reason, by=by)
    except AgentPoolError as exc:
        _refuse(exc)
    click.echo(
        f"{run_id}: was {before}; "
        + ("cancelled" if before not in ("completed", "failed", "cancelled") else "unchanged")
    )


@main.command()
@url_option
@click.argument("run_id", required=False)
@click.argument("tool_use_id", required=False)
@click.option("--deny", is_flag=True, help="Refuse the call(s): the model gets an is_error result with the reason.")
@click.option("--reason", default=None, help="Why; passed to the model on a denial.")
@click.option("--all", "every_run", is_flag=True, help="Every call every run waits on (with --agent: that agent's).")
@click.option("--agent", default=None, help="With --all: only runs of this agent (full path, name or module).")
@click.option("--yes", "-y", is_flag=True, help="With --all: decide without asking for a confirmation.")
@by_option("the decision and the run's approval event", default="person")
def approve(
    url: str | None,
    run_id: str | None,
    tool_use_id: str | None,
    deny: bool,
    reason: str | None,
    every_run: bool,
    agent: str | None,
    yes: bool,
    by: str,
) -> None:
    """Approve (or --deny) a call RUN_ID waits on; without TOOL_USE_ID, every call it waits on. With
    --all instead of RUN_ID, every call the runs waiting for approval (of --agent) wait on, after a
    confirmation."""
    if every_run:
        if run_id is not None:
            raise click.UsageError("give a RUN_ID or --all, not both")
        _decide_all(pool_client(url), agent=agent, approved=not deny, reason=reason, yes=yes, by=by)
        return
    if run_id is None:
        raise click.UsageError("give the RUN_ID to decide on, or --all (and --agent) for every run waiting")
    if agent is not None or yes:
        raise click.UsageError("--agent and --yes go with --all")
    from agentpool.client import get_run
    from agentpool.runtime.approvals import decide

    client = pool_client(url)
    verb = "denied" if deny else "approved"
    try:
        # Without TOOL_USE_ID: the calls the run waits on now, decided exactly as read and each printed
        # whole, so that whoever decided sees what (a call asked since is left for a decision of its own).
        waiting = {} if tool_use_id else {c["id"]: c for c in get_run(run_id, connection=client).awaiting_approval}
        ids = [tool_use_id] if tool_use_id else list(waiting) or None
        decided = decide(route(client, run_id), run_id, ids, approved=not deny, reason=reason or "", by=by)
    except AgentPoolError as exc:
        _refuse(exc)
    for call_id in decided:
        call = waiting.get(call_id)
        click.echo(f"{verb}: {call_id}" + (f" {call['name']} {json.dumps(call['input'])}" if call else ""))


def _decide_all(
    r: Redis | Shards, *, agent: str | None, approved: bool, reason: str | None, yes: bool, by: str
) -> None:
    """Decide on every call the waiting runs (of ``agent``) wait on: exactly the calls shown before the
    confirmation, so that a call a run asks for meanwhile is never decided unseen."""
    from agentpool.client import get_run, list_runs
    from agentpool.runtime.approvals import decide

    waiting = []
    for listed in list_runs(connection=r, limit=10**6, status="waiting_approval", agent=agent):
        try:
            run = get_run(listed.id, connection=r)
        except AgentPoolError:
            continue  # ended or unreadable since it was listed: `show` tells which
        if run.awaiting_approval:
            waiting.append(run)
    verb = "approve" if approved else "deny"
    calls = sum(len(run.awaiting_approval) for run in waiting)
    if not calls:
        click.echo(f"nothing to {verb}: no run{f' of {agent}' if agent else ''} waits for approval")
        return
    for run in waiting:
        for call in run.awaiting_approval:
            click.echo(f"{run.id} {run.agent}: {call['id']} {call['name']} {json.dumps(call['input'])}")  # whole
    if not yes:
        try:
            click.confirm(f"{verb.capitalize()} these {calls} call(s) in {len(waiting)} run(s)?", abort=True)
        except click.Abort:
            _fail("not confirmed: nothing decided (--yes decides without asking)")
    failed = 0
    for run in waiting:
        ids = [call["id"] for call in run.awaiting_approval]
        try:  # one transaction per run: all its calls decided, then its turn queued
            decide(route(r, run.id), run.id, ids, approved=approved, reason=reason or "", by=by)
        except AgentPoolError as exc:
            failed += 1
            click.echo(f"{run.id}: not decided: {exc}", err=True)
            continue
        click.echo(f"{run.id}: {'approved' if approved else 'denied'}: {', '.join(ids)}")
    if failed:
        sys.exit(1)


@main.command()
@url_option
@click.argument("run_id")
@click.option("--add-turns", type=LimitParam(whole=True, zero_ok=True), default=0, help="Turns to add to max_turns.")
@click.option(
    "--add-tokens", type=LimitParam(whole=True, zero_ok=True), default=0, help="Tokens to add to max_total_tokens."
)
@click.option("--add-usd", type=LimitParam(whole=False, zero_ok=True), default=0.0, help="USD to add to max_cost_usd.")
@by_option("the run's status (or limits_raised) event")
def resume(url: str | None, run_id: str, add_turns: int, add_tokens: int, add_usd: float, by: str | None) -> None:
    """Continue a stopped run from its checkpoint, raising its limits (or raise the limits of a run that
    completed at one, so that a message sent to it is answered). Its stopped sub-agent runs go on with it."""
    from agentpool.client import resume as resume_run
    from agentpool.client import run_tree

    r = pool_client(url)

    def stopped_below() -> list[str]:
        def walk(nodes: list[dict[str, Any]]) -> list[str]:
            return [n["id"] for n in nodes if n["status"] == "stopped"] + [
                i for n in nodes for i in walk(n["children"])
            ]

        return walk(run_tree(run_id, connection=r)["children"])

    try:
        before = stopped_below()
        run = resume_run(run_id, add_turns=add_turns, add_tokens=add_tokens, add_usd=add_usd, by=by, connection=r)
    except AgentPoolError as exc:
        _refuse(exc)
    click.echo(f"{run_id}: {run.status} at turn {run.turns}")
    if before:  # its stopped sub-agents go on with it, unless a limit of their own still stops them
        left = stopped_below()
        resumed = [child for child in before if child not in left]
        if resumed:
            click.echo(f"sub-agent runs resumed with it: {', '.join(resumed)}")
        if left:
            click.echo(f"left stopped (a limit of their own would stop them again at once): {', '.join(left)}")


@main.command()
@url_option
@click.argument("run_id")
@click.argument("text")
@click.option("--message-id", default=None, help="Your id for the message: sending it again delivers it once.")
@click.option("--wait", is_flag=True, help="Wait for the run's answer to this message and print it.")
@click.option("--timeout", type=LimitParam(whole=False), default=None, help="Seconds to --wait (default 600).")
@by_option("the event of the message's arrival")
def send(
    url: str | None, run_id: str, text: str, message_id: str | None, wait: bool, timeout: float | None, by: str | None
) -> None:
    """Send TEXT to RUN_ID as a user message; print the message's id. A running run gets it at its next
    turn boundary; a completed one goes on with it."""
    from agentpool.client import wait_for_run
    from agentpool.conversation import send_message

    _timeout_needs_wait(timeout, wait)
    r = pool_client(url)
    try:
        sent = send_message(run_id, text, message_id=message_id, by=by, connection=r)
    except (AgentPoolError, ValueError) as exc:
        _refuse(exc)
    click.echo(sent)
    if wait:
        run = wait_for_run(run_id, timeout=timeout or WAIT_TIMEOUT, connection=r, after_message=sent)
        click.echo(f"{run.status} after {run.turns} turns: {run.result or run.error or ''}")
        sys.exit(0 if run.status == "completed" else 1)


@main.command()
@url_option
@click.argument("run_id")
@click.option(
    "--at-turn", type=click.IntRange(min=0), default=None, help="Fork after this committed turn (default: the latest)."
)
@click.option("--fork-id", default=None, help="The new run's id: forking again with it returns the same run.")
@by_option("the new run's forked event")
def fork(url: str | None, run_id: str, at_turn: int | None, fork_id: str | None, by: str | None) -> None:
    """A new run with RUN_ID's conversation up to the end of a committed turn; print its id."""
    from agentpool.client import get_run
    from agentpool.conversation import fork_run

    r = pool_client(url)
    try:
        new_id = fork_run(run_id, at_turn=at_turn, fork_id=fork_id, by=by, connection=r)
        run = get_run(new_id, connection=r)
    except (AgentPoolError, ValueError) as exc:
        _refuse(exc)
    click.echo(new_id)
    click.echo(f"forked from {run_id} at turn {run.forked_at}: {run.status}", err=True)


@main.command()
@url_option
@click.argument("run_id")
@click.option("--events-only", is_flag=True, help="Events only, not the model's words as they stream.")
def watch(url: str | None, run_id: str, events_only: bool) -> None:
    """Follow a run live: its events, and the model's words as they arrive. Exits when the run ends."""
    from agentpool.store import checkpoint
    from agentpool.watching import watch as follow

    r = route(pool_client(url), run_id)
    try:
        state = checkpoint.load_run(r, run_id, with_messages=False)
    except AgentPoolError as exc:
        _refuse(exc)
    click.echo(f"run {run_id} ({state.agent}): {state.status}, turn {state.turns}, {sum(state.usage.values())} tokens")
    printer = _LivePrinter()
    for item in follow(run_id, connection=r, live_output=not events_only):
        if not printer.take(item):
            printer.break_line()
            if item["type"] == "waiting":  # what a run that is not moving waits for, when that changes
                click.echo(_event_line({"kind": "waiting", "note": str(item["note"])}, at=float(item["at"])))
                continue
            fields = {k: str(v) for k, v in item.items() if k not in ("id", "at")}
            click.echo(_event_line(fields, at=float(item["at"])))  # type: ignore[arg-type]
    printer.break_line()
    state = checkpoint.load_run(r, run_id, with_messages=False)
    click.echo(
        f"run {run_id} {state.status} after {state.turns} turns, {sum(state.usage.values())} tokens"
        + (f": {state.error}" if state.error else "")
    )


LIVE_PREFIX = {"text_delta": "", "thinking_delta": "(thinking) ", "input_json_delta": "-> "}


class _LivePrinter:
    """Prints a streaming call's text as it arrives, one line per content block, between event lines."""

    def __init__(self) -> None:
        self.block: tuple[str, int] | None = None
        self.mid_line = False

    def take(self, item: dict[str, object]) -> bool:
        """Print a live item; False for an event (the caller prints it)."""
        kind = str(item["type"])
        if kind in ("block_start", "call_start", "call_end"):
            return True
        if kind not in LIVE_PREFIX:
            return False
        block = (str(item.get("call")), int(item.get("index") or 0))  # type: ignore[call-overload]
        if block != self.block:
            self.break_line()
            self.block = block
            head = LIVE_PREFIX[kind] + (f"{item['name']} " if kind == "input_json_delta" and item.get("name") else "")
            click.echo(f"{time.strftime('%H:%M:%S')} {'model':<18} {head}", nl=False)
        text = str(item.get("text", ""))
        click.echo(text.replace("\n", "\n" + " " * 28), nl=False)  # lines under the text's first
        sys.stdout.flush()
        self.mid_line = not text.endswith("\n")
        return True

    def break_line(self) -> None:
        if self.mid_line:
            click.echo("")
        self.mid_line = False
        self.block = None


# Event fields that hold a moment as epoch seconds (a wait's end): shown on the same clock as the stamp.
CLOCK_FIELDS = frozenset({"until"})


def _event_line(event: dict[str, str], at: float) -> str:
    """One event, stamped with its own time (when Redis recorded it), to the millisecond."""
    from agentpool.runtime.progress import clock

    kind = event.pop("kind", None) or event.pop("type", "?")
    detail = " ".join(f"{k}={_clock_field(v) if k in CLOCK_FIELDS else v}" for k, v in event.items())
    return f"{clock(at, millis=True)} {kind:<18} {detail}"


def _clock_field(value: str) -> str:
    from agentpool.runtime.progress import clock

    try:
        return clock(float(value), millis=True)
    except (ValueError, OverflowError, OSError):  # not a moment after all: shown as it is
        return value


@main.command()
@url_option
@click.option("--interval", type=LimitParam(whole=False), default=1.0, show_default=True, help="Seconds between scans.")
@click.option("--once", is_flag=True, help="Scan once, print what was done (or 'nothing to do') and exit.")
def reap(url: str | None, interval: float, once: bool) -> None:
    """Re-enqueue turns whose worker died, deny approvals past their deadline (the reaper every worker
    also runs). Prints one line for each thing it does."""
    from redis.exceptions import RedisError

    from agentpool.runtime.reaper import reap_once
    from agentpool.store.keys import RUNS_WATCH

    # Each thing done is reported below; the takeover module's own warning would say it twice.
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s")

    done: list[str] = []

    def report(run_id: str, what: str) -> None:
        done.append(run_id)
        click.echo(f"{time.strftime('%H:%M:%S')} {run_id}: {what}")

    if not once:
        # Like a worker, the loop rides out a Redis restart. On a sharded pool each shard is reaped by a
        # thread of its own (a shard's reaper reads only its shard): a shard that does not answer holds
        # up its own thread's ~15 s of retries, not the others' scans.
        urls = shard_urls(url) or [target_url(url)]
        threads = [
            threading.Thread(target=_reap_forever, args=(connect(u), interval, report), daemon=True) for u in urls
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return
    silent = []
    pool = [r for _shard, r in each(pool_client(url))]
    for r in pool:
        try:
            reap_once(r, report=report)
        except RedisError as exc:
            if len(pool) == 1:
                raise
            silent.append(describe(exc))  # one shard's trouble is its own: the others are reaped all the same
    for line in silent:
        click.echo(f"error: not reaped: {line}", err=True)
    if not done and not silent:
        watched = sum(r.zcard(RUNS_WATCH) for r in pool)
        click.echo(f"nothing to do: none of the {watched} runs watched is orphaned or past a deadline")
    if silent:
        sys.exit(1)


def _reap_forever(r: Any, interval: float, report: Any) -> None:
    from redis.exceptions import RedisError

    from agentpool.runtime.reaper import reap_once

    while True:
        try:
            reap_once(r, report=report)
        except RedisError as exc:
            click.echo(f"warning: {describe(exc)}; retrying", err=True)
        except Exception:  # a bug: said, and the next scan tried all the same (as a worker's reaper does)
            logging.getLogger("agentpool.reaper").exception("reaper: unexpected error")
        time.sleep(interval)


@main.command()
def genkey() -> None:
    """Print a new key for AGENTPOOL_ENCRYPTION_KEY (encryption at rest)."""
    from agentpool.store.crypto import generate_key

    click.echo(generate_key())


@main.command()
@url_option
@click.option(
    "--strict",
    is_flag=True,
    help="Also exit non-zero when a server setting puts runs at risk (an evicting maxmemory-policy, cluster mode) "
    "or cannot be checked: for a deploy pipeline, not for probes.",
)
@click.option(
    "--shard",
    "shard_picks",
    multiple=True,
    help="On a sharded pool: check only this shard (repeatable), as a probe of a worker serving it should.",
)
@click.option(
    "--worker",
    "worker_here",
    is_flag=True,
    help="Also exit non-zero until a worker started on this machine is registered in the pool (on each "
    "shard checked): a readiness probe for a worker's pod.",
)
def check(url: str | None, strict: bool, shard_picks: tuple[str, ...], worker_here: bool) -> None:
    """Exit 0 if Redis answers within 2 s (for liveness/readiness probes), non-zero otherwise. Server
    settings that put runs at risk, and a durability guard that cannot be met (no replica acknowledges),
    are printed as warnings (and fail the check with --strict). On a sharded pool, every shard (or
    those given with --shard). With --worker, also whether a worker process of this machine
    (``agentpool worker``) has taken its place in the pool: registered in RQ, on each shard checked."""
    from redis.exceptions import RedisError

    from agentpool.runtime.durability import unmet
    from agentpool.runtime.redis_checks import hazards
    from agentpool.runtime.settings import server_of
    from agentpool.worker import ready

    here = ready.noted() if worker_here else []
    missing: list[str] = []

    picked = _shards_served(url, shard_picks)[0] if shard_picks else None
    pool = pool_client(url, socket_timeout=2, retries=0)  # a probe answers within 2 s; its caller retries
    found: list[str] = []
    unreachable = 0
    for shard, client in each(pool):
        if picked is not None and shard not in picked:
            client.close()
            continue
        said = f"{pool.name(shard)}: " if shard is not None else ""  # type: ignore[union-attr]
        try:
            client.ping()
            found += [said + hazard for hazard in hazards(client)]
            guard = unmet(client)
            found += [said + guard] if guard else []
            if worker_here:
                keys = [note["key"] for note in here if note.get("server") == server_of(client)]
                if not keys or not client.exists(*keys):
                    missing.append(f"{said}no worker of this machine is registered (yet)")
        except RedisError as exc:
            if shard is None:
                raise  # one Redis: the group's one line says where
            click.echo(f"error: {describe(exc)}", err=True)  # every shard is checked and each failure said
            unreachable += 1
        finally:
            client.close()
    for hazard in found:
        click.echo(f"warning: {hazard}", err=True)
    if strict and found:
        raise click.ClickException(f"{len(found)} problem(s) put runs at risk or make them wait (above)")
    for line in missing:
        click.echo(f"error: {line}", err=True)
    if unreachable or missing:
        sys.exit(1)
    click.echo("ok")


if __name__ == "__main__":
    main()
