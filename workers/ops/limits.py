"""``agentpool limits``: the pool's shared limits. ``show``: every model's rate-limit budget, what the
pool learned from the API's headers, what ``AGENTPOOL_RATE_LIMITS`` sets here, what is left and reserved
now, and how many turns wait in line; every concurrency key's turns in flight, waiting and limit.
``set KEY N`` / ``unset KEY``: an operator's limit for a concurrency key, which wins over the runs' own
``max_concurrency``.

On a sharded pool (``AGENTPOOL_SHARDS``) each shard keeps its own budgets (an equal part of each limit:
docs/sharding.md), shown shard by shard; an operator's concurrency limit is set on every shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from agentpool.ops.redisconn import pool_client
from agentpool.runtime.shards import each

if TYPE_CHECKING:
    from redis import Redis

    from agentpool.runtime.settings import Settings

url_option = click.option("--url", "-u", envvar="REDIS_URL", default=None, help="Redis URL (env REDIS_URL).")
_LABELS = {"requests": "requests/min", "input": "input tokens/min", "output": "output tokens/min"}


@click.group()
def limits() -> None:
    """The pool's shared limits: model rate limits and concurrency keys (show, set, unset)."""


@limits.command("set")
@url_option
@click.argument("key")
@click.argument("limit", type=click.IntRange(min=1))
def set_limit(url: str | None, key: str, limit: int) -> None:
    """At most LIMIT turns of concurrency key KEY in flight across the pool (wins over max_concurrency)."""
    from agentpool.store import concurrency

    try:
        # every shard: a key's runs may be on any after a shard is added
        woken = sum(concurrency.set_limit(r, key, limit) for _shard, r in each(pool_client(url)))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None
    click.echo(f"{key}: at most {limit} turn(s) in flight" + (f"; {woken} waiting turn(s) woken" if woken else ""))


@limits.command("unset")
@url_option
@click.argument("key")
def unset_limit(url: str | None, key: str) -> None:
    """Drop the operator's limit for KEY: the runs' own max_concurrency holds again."""
    from agentpool.store import concurrency

    try:
        woken = sum(concurrency.set_limit(r, key, None) for _shard, r in each(pool_client(url)))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None
    click.echo(f"{key}: the runs' own max_concurrency holds" + (f"; {woken} waiting turn(s) woken" if woken else ""))


@limits.command()
@url_option
def show(url: str | None) -> None:
    """Each model's budget: limits learned and set, what is left now, what calls in flight hold."""
    from agentpool.runtime.settings import Settings
    from agentpool.runtime.shards import Shards

    settings = Settings.from_env()
    pool = pool_client(url)
    for shard, r in each(pool):
        if isinstance(pool, Shards) and shard is not None:
            click.echo(f"{chr(10) if shard else ''}{pool.name(shard)}: its part (1/{len(pool)}) of each limit")
        _show(r, settings, shards=len(settings.shards))


def _show(r: Redis, settings: Settings, *, shards: int) -> None:
    from agentpool.store import ratelimit
    from agentpool.store.clock import now_ms

    views = ratelimit.show(r)
    if not views:
        click.echo("no model call has gone through the pool's rate limiter yet")
    minute = settings.rate_limit_minute
    for view in views:
        configured = _configured(settings.rate_limits, view.model, shards)
        click.echo(f"{view.model}: {view.held['calls']} call(s) in flight, {view.waiting} turn(s) waiting in line")
        click.echo(
            f"  {'':<18} {'learned':>10} {'set here':>10} {'in force':>10} {'left now':>10} {'reserved':>10} "
            f"{'in line':>10}"
        )
        clears = 0.0  # seconds of refill the line needs beyond what is left, in its slowest dimension
        for dim in ratelimit.DIMENSIONS:
            learned = view.learned.get(dim)
            cap = configured.get(dim)
            limit = min(v for v in (learned, cap) if v) if (learned or cap) else None
            left = None
            if limit and dim in view.levels:
                elapsed = max(0.0, (now_ms() - view.at_ms) / 1000)
                left = min(limit, view.levels[dim] + elapsed * limit / minute)
            reserved = f"{view.held.get(dim, view.held['calls'] if dim == 'requests' else 0):,}"
            in_line = view.in_line.get(dim)
            if limit and in_line is not None:
                clears = max(clears, (in_line - (left or 0.0)) * minute / limit)
            click.echo(
                f"  {_LABELS[dim]:<18} {_num(learned):>10} {_num(cap):>10} {_num(limit) or 'none':>10} "
                f"{'' if left is None else f'{left:,.0f}':>10} {reserved:>10} {_num(in_line):>10}"
            )
        if view.in_line:
            click.echo(f"  the turns in line need about {clears:.0f} s of refill at the limits in force")
    if not settings.rate_limiter:
        click.echo("\nnote: AGENTPOOL_RATE_LIMITER=off here: workers started with it do not use these budgets")
    from agentpool.store import concurrency

    keys = concurrency.show(r)
    if keys:
        click.echo(f"\n{'CONCURRENCY KEY':<30} {'LIMIT SET':>9} {'IN FLIGHT':>9} {'WAITING':>8}")
    for view in keys:
        limit = str(view.operator_limit) if view.operator_limit else "-"
        click.echo(f"{view.key:<30} {limit:>9} {view.in_flight:>9} {view.waiting:>8}")


def _configured(configured: dict, model: str, shards: int) -> dict[str, int]:
    from agentpool.runtime.ratelimit import shard_part
    from agentpool.store.ratelimit import Limits

    chosen: Limits = shard_part(configured.get(model) or configured.get("*") or Limits(), shards)
    return {
        d: v for d, v in zip(("requests", "input", "output"), (chosen.rpm, chosen.itpm, chosen.otpm), strict=True) if v
    }


def _num(value: float | None) -> str:
    return f"{value:,.0f}" if value else ""
