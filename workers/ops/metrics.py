"""Prometheus metrics for the whole pool, read from Redis at scrape time.

Nothing is counted in the exporting process: every number comes from Redis when Prometheus asks, so
``agentpool metrics`` (a process of its own) and ``agentpool worker --metrics-port`` (any worker)
export the same pool-wide values, and a restarted exporter loses nothing. Counters and histograms come
from the ``ap:stats`` hash (store/stats.py); run counts by status from the run headers; queue depth
from RQ's keys.

Cost of one scrape: one HGETALL of ``ap:stats``, a few O(1) reads of RQ's keys, and the run-status
count. ``ap:runs`` keeps every run ever created, so the status count looks only at the newest
``max_runs`` of them (default 10,000): ZREVRANGE in pages of 500, each page one pipelined round trip
of HGET status. Runs older than that window are left out of ``agentpool_runs`` and counted in
``agentpool_runs_indexed``; runs that are queued or running are also counted exactly, whatever their
age, by ``agentpool_runs_active`` (the reaper's watch set).

On a sharded pool (``AGENTPOOL_SHARDS``) every family is the sum over the shards (the longest wait for
the two ``..._seconds`` gauges, ``max_runs`` per shard for ``agentpool_runs``), and what tells a shard
from another is exported per shard too, with a ``shard`` label: ``agentpool_shard_up``, and
``agentpool_shard_turns``, ``..._runs_active``, ``..._queue_jobs``, ``..._workers``, ``..._turns_deferred``
and ``..._turns_deferred_overdue_seconds``. A shard that does not answer makes ``agentpool_redis_up`` 0
and leaves the sums out of that scrape (a sum missing a shard would look like a counter reset).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping

import click
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError
from rq import Queue
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from agentpool.ops.redisconn import pool_client, target_url, warn_if_unreachable
from agentpool.runtime import deferred
from agentpool.runtime.jobs import agentpool_queues
from agentpool.runtime.settings import redact_url
from agentpool.runtime.shards import Shards, on_every_shard
from agentpool.store import stats
from agentpool.store.keys import DEFAULT_QUEUE, RUNS, RUNS_WATCH, TURN_QUEUE, RunKeys
from agentpool.store.records import STATUSES

log = logging.getLogger("agentpool.metrics")

DEFAULT_MAX_RUNS = 10_000
PAGE = 500

# Spend is priced per model (workers/pricing.py) when a reply arrives; the model_responded event
# carries it and agentpool.store.stats adds it up under this field.
COST_FIELD = "cost_usd"

# (ap:stats metric, label name, help text, label values always exported, at 0 until seen)
COUNTERS: tuple[tuple[str, str | None, str, tuple[str, ...]], ...] = (
    (
        "turns",
        None,
        (
            "Turn starts: each time a worker took a turn's lease, retries after a crash or a model error, "
            "tool-only turns after an approval and turns a limit stops before the call included; "
            "a turn a worker handed back is not counted."
        ),
        (),
    ),
    (
        "tool_calls",
        "effect",
        "Tool executions started (an intent written), re-runs after a crash included, by effect class.",
        ("read", "idempotent", "unsafe"),
    ),
    (
        "reconciliations",
        "outcome",
        "Dangling tool_uses settled after a crash without running, by outcome (replayed, verified, unknown).",
        ("replayed", "verified", "unknown"),
    ),
    (
        "takeovers",
        "cause",
        "Turns re-enqueued because their worker was gone, by cause.",
        ("horse_death", "lease_expiry", "job_lost"),
    ),
    (
        "handbacks",
        "reason",
        "Turns a worker gave back because it could not do them (another worker may), by reason.",
        ("key_missing", "key_not_held", "too_new", "agent_not_loadable", "not_replicated"),
    ),
    ("model_errors", "type", "Transient model API errors whose turn was retried later, by type.", ()),
    (
        "budget_waits",
        "model",
        "Turns deferred because the pool's rate-limit budget for the model could not cover their call yet.",
        (),
    ),
    (
        "concurrency_waits",
        "key",
        "Turns deferred because their concurrency key had max_concurrency turns in flight already.",
        (),
    ),
    ("tokens", "kind", "Tokens of every model call paid for, by kind.", stats.TOKEN_FIELDS),
    (
        "compactions",
        "mode",
        "Conversations compacted past the context window: by the API (server) or by a summary call (summary).",
        ("server", "summary"),
    ),
    ("status_changes", "status", "Runs entering a status (a resumed run enters running again).", ()),
)
HISTOGRAMS = (
    (
        "turn_seconds",
        (
            "Wall time of a turn that ran tools and committed them (save point B), from lease to commit; "
            "final turns, turns that stop, fail or wait for a person, and turns lost to a crash are not counted."
        ),
    ),
    ("model_call_seconds", "Wall time of one model call that answered; _count is the number of calls paid for."),
)


def _split(field_name: str) -> tuple[str, dict[str, str]]:
    metric, *parts = field_name.split("|")
    labels = dict(p.split("=", 1) for p in parts if "=" in p)
    return metric, labels


class PoolCollector(Collector):
    """Reads the pool's state from Redis on every ``collect()``; holds no state of its own."""

    def __init__(self, r: Redis | Shards, *, max_runs: int = DEFAULT_MAX_RUNS) -> None:
        self.r = r
        self.max_runs = max_runs

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("agentpool_redis_up", "1 if Redis answered this scrape, 0 if it did not.")
        if isinstance(self.r, Shards):
            yield from self._sharded(up)
            return
        try:
            families = self.families()
        except RedisError as exc:
            log.warning("metrics scrape: Redis failed: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def families(self) -> list[Metric]:
        """Every family but ``agentpool_redis_up``, read from this collector's one Redis."""
        return [*self._from_stats(stats.read_all(self.r)), *self._runs(), *self._queue()]

    # -- a sharded pool ----------------------------------------------------------------------

    def _sharded(self, up: GaugeMetricFamily) -> Iterator[Metric]:
        shard_up = GaugeMetricFamily(
            "agentpool_shard_up", "1 if the shard's Redis answered this scrape, 0 if it did not.", labels=["shard"]
        )
        per_shard: dict[int, list[Metric]] = {}
        # Every shard read at once: shards that do not answer cost one socket timeout, not one each.
        clients = self.r.clients  # type: ignore[union-attr]
        pages = on_every_shard(clients, lambda client: PoolCollector(client, max_runs=self.max_runs).families())
        for shard, outcome in enumerate(pages):
            if isinstance(outcome, RedisError):
                log.warning("metrics scrape: shard %s's Redis failed: %s", shard, outcome)
                shard_up.add_metric([str(shard)], 0)
            elif isinstance(outcome, Exception):
                raise outcome
            else:
                per_shard[shard] = outcome
                shard_up.add_metric([str(shard)], 1)
        whole = len(per_shard) == len(self.r)  # type: ignore[arg-type]
        up.add_metric([], 1 if whole else 0)
        yield up
        yield shard_up
        if whole:  # a sum over the shards that answered would read as the pool's and be short
            yield from merged(list(per_shard.values()))
        yield from by_shard(per_shard)  # each shard that answered, under its own number

    # -- ap:stats ----------------------------------------------------------------------------

    def _from_stats(self, raw: Mapping[str, float]) -> list[Metric]:
        by_metric: dict[str, dict[str, float]] = {}
        for field_name, value in raw.items():
            metric, labels = _split(field_name)
            by_metric.setdefault(metric, {})[labels.get("le") or next(iter(labels.values()), "")] = value
        out: list[Metric] = []
        for metric, label, help_text, preset in COUNTERS:
            family = CounterMetricFamily(f"agentpool_{metric}", help_text, labels=[label] if label else None)
            seen = by_metric.get(metric, {})
            if label is None:
                family.add_metric([], seen.get("", 0.0))
            else:
                for label_value in sorted(set(preset) | set(seen)):
                    family.add_metric([label_value], seen.get(label_value, 0.0))
            out.append(family)
        if COST_FIELD in raw:
            out.append(
                CounterMetricFamily(
                    "agentpool_cost_usd", "Spend on model calls, priced per model, in USD.", value=raw[COST_FIELD]
                )
            )
        for metric, help_text in HISTOGRAMS:
            out.append(_histogram(metric, help_text, by_metric.get(metric, {}), raw.get(f"{metric}_sum", 0.0)))
        return out

    # -- runs --------------------------------------------------------------------------------

    def _runs(self) -> list[Metric]:
        counts = dict.fromkeys(sorted(STATUSES), 0)
        indexed = int(self.r.zcard(RUNS))
        for start in range(0, min(indexed, self.max_runs), PAGE):
            stop = min(start + PAGE, self.max_runs) - 1
            ids = self.r.zrevrange(RUNS, start, stop)
            if not ids:
                break
            with self.r.pipeline(transaction=False) as pipe:
                for run_id in ids:
                    pipe.hget(RunKeys.of(run_id.decode() if isinstance(run_id, bytes) else str(run_id)).run, "status")
                for status in pipe.execute():
                    name = (status or b"").decode(errors="replace")
                    if name in counts:
                        counts[name] += 1
        by_status = GaugeMetricFamily(
            "agentpool_runs", f"Runs by status, among the newest {self.max_runs} runs.", labels=["status"]
        )
        for name, n in counts.items():
            by_status.add_metric([name], n)
        return [
            by_status,
            GaugeMetricFamily("agentpool_runs_indexed", "Runs in the ap:runs index (every run kept).", value=indexed),
            GaugeMetricFamily(
                "agentpool_runs_active",
                "Runs the reaper watches: queued or running, or waiting for an approval with a deadline (exact, any age).",
                value=int(self.r.zcard(RUNS_WATCH)),
            ),
            *self._waiting_for_replica(),
        ]

    def _waiting_for_replica(self) -> list[Metric]:
        """Active runs whose turn was handed back because no replica acknowledged (the durability guard),
        and for how long the oldest has waited: one HMGET per active run (the watch set)."""
        waiting, oldest = 0, None
        active = self.r.zrange(RUNS_WATCH, 0, -1)
        for start in range(0, len(active), PAGE):
            with self.r.pipeline(transaction=False) as pipe:
                for run_id in active[start : start + PAGE]:
                    pipe.hmget(RunKeys.of(run_id.decode(errors="replace")).handback, ["reason", "since"])
                for reason, since in pipe.execute():
                    if reason == b"not_replicated":
                        waiting += 1
                        oldest = min(oldest or float("inf"), int(since or 0) / 1000)
        return [
            GaugeMetricFamily(
                "agentpool_runs_waiting_for_replica",
                "Active runs waiting for a replica to acknowledge a tool's intent (the durability guard, "
                "AGENTPOOL_REPLICA_ACKS): nothing with an effect runs for them until one does.",
                value=waiting,
            ),
            GaugeMetricFamily(
                "agentpool_replica_wait_seconds",
                "How long the longest-waiting of those runs has waited for a replica (0: none waits).",
                value=max(0.0, time.time() - oldest) if oldest else 0.0,
            ),
        ]

    # -- RQ ----------------------------------------------------------------------------------

    def _live_workers(self, members: set[bytes]) -> set[bytes]:
        """The members of RQ's worker sets whose record is still there. RQ drops a dead worker from the sets
        only when something cleans them (``rq info``, a worker's maintenance every 10 minutes), which a
        scrape must not do; its record expires on its own within 90 s (``agentpool.worker.lean``)."""
        keys = list(members)
        with self.r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            alive = pipe.execute()
        return {key for key, there in zip(keys, alive, strict=True) if there}

    def _queue(self) -> list[Metric]:
        names = agentpool_queues(self.r)
        with self.r.pipeline(transaction=False) as pipe:
            for name in names:
                queue = Queue(name, connection=self.r)
                pipe.llen(queue.key)
                # ZCARD, not registry.count: that runs RQ's cleanup, and a scrape must not change state.
                for registry in (queue.scheduled_job_registry, queue.started_job_registry, queue.failed_job_registry):
                    pipe.zcard(registry.key)
                pipe.smembers(WORKERS_BY_QUEUE_KEY % name)
            replies = pipe.execute()
        depth = GaugeMetricFamily(
            "agentpool_queue_jobs",
            f"Turn jobs on agentpool's RQ queues ({TURN_QUEUE!r} for the queue default, agentpool-<name> for the "
            "others), all together: queued (waiting for a worker), scheduled (RQ's scheduled registry: agentpool "
            "puts nothing there), started (in a worker now), failed (RQ's failed registry).",
            labels=["state"],
        )
        by_queue = GaugeMetricFamily(
            "agentpool_queue_jobs_by_queue",
            "agentpool_queue_jobs per queue (agentpool's name for it: default, urgent, ...).",
            labels=["queue", "state"],
        )
        workers_by_queue = GaugeMetricFamily(
            "agentpool_workers_by_queue",
            "RQ workers registered on each of agentpool's queues whose RQ record has not expired.",
            labels=["queue"],
        )
        totals = dict.fromkeys(("queued", "scheduled", "started", "failed"), 0)
        per_queue = [replies[5 * i : 5 * i + 5] for i in range(len(names))]
        workers = self._live_workers({member for *_, members in per_queue for member in members})
        for name, (queued, scheduled, started, failed, members) in zip(names, per_queue, strict=True):
            label = DEFAULT_QUEUE if name == TURN_QUEUE else name[len(TURN_QUEUE) + 1 :]
            for state, n in (("queued", queued), ("scheduled", scheduled), ("started", started), ("failed", failed)):
                totals[state] += int(n)
                by_queue.add_metric([label, state], int(n))
            workers_by_queue.add_metric([label], len(workers & members))
        for state, n in totals.items():
            depth.add_metric([state], n)
        count, overdue = deferred.summary(self.r)
        return [
            depth,
            by_queue,
            GaugeMetricFamily(
                "agentpool_workers", "agentpool_workers_by_queue's workers, on any queue.", value=len(workers)
            ),
            workers_by_queue,
            GaugeMetricFamily(
                "agentpool_turns_deferred",
                "Turns deferred to later (a model retry's backoff), not RQ jobs until due (ap:turns:deferred).",
                value=count,
            ),
            GaugeMetricFamily(
                "agentpool_turns_deferred_overdue_seconds",
                "How long past its due time the oldest deferred turn still waits to be enqueued (0: none "
                "overdue). Above ~2 s, no reaper is running: no worker, nor `agentpool reap`.",
                value=overdue,
            ),
        ]


# Families whose pool-wide value is the largest shard's (a wait), not the sum; and those also exported per shard.
LONGEST = frozenset({"agentpool_turns_deferred_overdue_seconds", "agentpool_replica_wait_seconds"})
PER_SHARD = (
    "agentpool_turns",
    "agentpool_runs_active",
    "agentpool_queue_jobs",
    "agentpool_workers",
    "agentpool_turns_deferred",
    "agentpool_turns_deferred_overdue_seconds",
)


def merged(per_shard: list[list[Metric]]) -> list[Metric]:
    """The shards' families as one pool's: each sample summed over the shards (or their largest, LONGEST)."""
    out: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for families in per_shard:
        for family in families:
            if family.name not in out:
                out[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            seen = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                before = seen.get(key)
                if before is None:
                    seen[key] = sample.value
                else:
                    seen[key] = max(before, sample.value) if family.name in LONGEST else before + sample.value
    for name, family in out.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(out.values())


def by_shard(per_shard: dict[int, list[Metric]]) -> list[Metric]:
    """The PER_SHARD families again, as ``agentpool_shard_<name>`` with a ``shard`` label."""
    out: dict[str, Metric] = {}
    for shard, families in per_shard.items():
        for family in families:
            if family.name not in PER_SHARD:
                continue
            name = family.name.replace("agentpool_", "agentpool_shard_", 1)
            if name not in out:
                out[name] = Metric(name, f"{family.documentation} Per shard.", family.type)
            for sample in family.samples:
                renamed = sample.name.replace("agentpool_", "agentpool_shard_", 1)
                out[name].add_sample(renamed, {"shard": str(shard), **sample.labels}, sample.value)
    return list(out.values())


def _histogram(metric: str, help_text: str, buckets: Mapping[str, float], total: float) -> Metric:
    bounds = sorted(stats.LATENCY_BUCKETS)
    rows = []
    cumulative = 0.0
    for bound in bounds:
        key = "+Inf" if bound == float("inf") else f"{bound:g}"
        # stats counts each observation in its own bucket only; Prometheus buckets are cumulative.
        # stats writes int-valued bounds as "1", "5"; "{:g}" reads both spellings alike
        cumulative += buckets.get(key, buckets.get(str(bound), 0.0))
        rows.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))  # Prometheus spells 1 "1.0"
    return HistogramMetricFamily(f"agentpool_{metric}", help_text, buckets=rows, sum_value=total)


def scrape_client(url: str | None = None) -> Redis | Shards:
    """The client a metrics endpoint reads Redis with: short timeouts and no retries (redis-py retries
    three times by default), so with Redis hung or gone a scrape answers ``agentpool_redis_up 0`` within
    Prometheus's scrape timeout instead of hanging, each hung scrape holding a thread and a connection.
    Never a worker's own client: that one retries for ~15 s and has no socket timeout, to ride out a
    Redis restart without failing a turn. On a sharded pool, such a client per shard."""
    return pool_client(url, socket_timeout=5, retries=0)


def registry_for(r: Redis | Shards, *, max_runs: int = DEFAULT_MAX_RUNS) -> CollectorRegistry:
    """A registry holding only the pool collector (no process metrics: they would describe the
    exporter, not the pool)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(r, max_runs=max_runs))
    return registry


def start_metrics_server(
    port: int, r: Redis | Shards, *, host: str = "127.0.0.1", max_runs: int = DEFAULT_MAX_RUNS
) -> None:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread (it dies with the worker), reading
    Redis through ``r``: give it a ``scrape_client``."""
    start_http_server(port, addr=host, registry=registry_for(r, max_runs=max_runs))
    log.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)


@click.command()
@click.option("--url", "-u", envvar="REDIS_URL", default=None, help="Redis URL (env REDIS_URL).")
@click.option("--port", "-p", type=int, required=True, help="Port to serve /metrics on.")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; 0.0.0.0 for a Prometheus on another machine (the deploy manifests pass it).",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_RUNS,
    show_default=True,
    help="How many of the newest runs agentpool_runs counts, per scrape.",
)
def metrics(url: str | None, port: int, host: str, max_runs: int) -> None:
    """Serve pool-wide Prometheus metrics read from Redis (any number of these may run)."""
    r = scrape_client(url)
    try:
        start_metrics_server(port, r, host=host, max_runs=max_runs)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    source = ", ".join(r.names) if isinstance(r, Shards) else redact_url(target_url(url))
    click.echo(f"agentpool metrics on http://{host}:{port}/metrics from {source}", err=True)
    warn_if_unreachable(r, "serving agentpool_redis_up 0 until it answers")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
