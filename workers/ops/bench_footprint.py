"""``agentpool bench --only footprint``: the Redis memory a run takes, for sizing a pool's Redis.

Runs of ``--footprint-turns`` turns, each turn a tool call whose result is a text of a given size, are
made to completion on one threaded worker; what they hold is read two ways. What every key of the
database holds (``MEMORY USAGE``, every element counted, and the keyspace's own tables from ``MEMORY
STATS``), before and after, divided by the runs, gives everything a finished run leaves: its keys, and
its entries in the pool's indexes (the run index, the runs to watch). Not ``INFO memory``'s
``used_memory``: it moves by tens of KB while nothing is written (clients' buffers shrinking as they
idle, the Lua VM's garbage, a script loaded by the stats thread's first flush), more than a few runs
hold, and the figure came out negative. ``MEMORY USAGE`` of each of one run's keys says where it goes:
the conversation, the event stream (capped at ``MAX_EVENTS`` entries), the ledger, the header, the
rest. The run's conversation as stored (the bytes
of its messages, ``STRLEN``-like) is printed beside them: what a run costs beyond what it says.

A finished run stays for the retention (``AGENTPOOL_RETENTION_SECONDS``, 7 days): Redis holds about
(runs finished a day) x (retention in days) x (a run's figure), plus the runs in flight.
"""

from __future__ import annotations

from collections import defaultdict

from redis import Redis

from agentpool.agent import Agent
from agentpool.ops.bench import MODEL, Lab, table, task, until
from agentpool.store.events import MAX_EVENTS
from agentpool.store.keys import RunKeys
from agentpool.tools import tool

AGENT = "agentpool.ops.bench_footprint:footprint_agent"
PROSE = "the quarterly report lists revenue by region and notes the open issues with each supplier"


@tool(effect="read")
def bench_fetch(chars: int) -> str:
    """Fetch a document of about ``chars`` characters (prose-like text, as a file or a page would be)."""
    return (PROSE + ". ") * (chars // (len(PROSE) + 2)) + PROSE[: chars % (len(PROSE) + 2)]


footprint_agent = Agent(model=MODEL, system="You are a benchmark.", tools=[bench_fetch], max_turns=200)


def _steps(turns: int, chars: int) -> list[dict]:
    fetch = {"tool_calls": [{"name": "bench_fetch", "input": {"chars": chars}}], "text": "Reading the next part."}
    return [fetch] * (turns - 1) + [{"text": "Done: the documents are summarized."}]


def _where_it_goes(r: Redis, run_id: str) -> dict[str, int]:
    """Bytes of each of the run's keys (``MEMORY USAGE``, every element sampled), by its role."""
    keys = RunKeys.of(run_id)
    roles = {keys.messages: "conversation", keys.events: "events", keys.ledger: "ledger", keys.run: "header"}
    found: dict[str, int] = defaultdict(int)
    for key in keys.all():
        size = r.memory_usage(key, samples=0)
        if size:
            found[roles.get(key, "other")] += int(size)
    return found


def _conversation_bytes(r: Redis, run_id: str) -> int:
    return sum(len(blob) for blob in r.lrange(RunKeys.of(run_id).messages, 0, -1))


def _keys_hold(r: Redis) -> int:
    """Bytes the database's keys hold: each key's ``MEMORY USAGE`` (its name, value and every element) and
    the keyspace's hash tables (``MEMORY STATS``: the keys' and the expiries' entries)."""
    held = sum(int(r.memory_usage(key, samples=0) or 0) for key in r.scan_iter(count=1000))
    tables = r.memory_stats().get(f"db.{r.connection_pool.connection_kwargs.get('db', 0)}") or {}
    return held + sum(int(v) for k, v in tables.items() if k.startswith("overhead.hashtable"))


def bench_footprint(lab: Lab, runs: int, turns: int, sizes: tuple[int, ...]) -> None:
    from agentpool.client import enqueue_run, wait_for_run

    rows = []
    for chars in sizes:
        lab.reset({"fp": _steps(turns, chars)})
        lab.start("--concurrency", "4")
        warm = enqueue_run(AGENT, task("fp", 0), connection=lab.r)  # the scripts loaded, the indexes made
        wait_for_run(warm, timeout=120, connection=lab.r)
        before = _keys_hold(lab.r)
        ids = [enqueue_run(AGENT, task("fp", n), connection=lab.r) for n in range(1, runs + 1)]
        finished = [wait_for_run(run_id, timeout=300, connection=lab.r) for run_id in ids]
        if any(run.status != "completed" for run in finished):
            raise RuntimeError(f"footprint runs did not complete: {[run.status for run in finished]}")
        last_lease = RunKeys.of(ids[-1]).lease
        until(lambda: not lab.r.exists(last_lease), 30, "the last lease to go", lab)  # noqa: B023 - used at once
        per_run = (_keys_hold(lab.r) - before) / runs
        parts = _where_it_goes(lab.r, ids[0])
        stored = _conversation_bytes(lab.r, ids[0])
        events = lab.r.xlen(RunKeys.of(ids[0]).events)
        rows.append(
            [
                f"{turns} turns, results of {chars:,} chars",
                f"{per_run / 1000:,.1f}",
                f"{per_run / turns / 1000:,.2f}",
                f"{stored / 1000:,.1f}",
                f"{parts['conversation'] / 1000:,.1f}",
                f"{parts['events'] / 1000:,.1f} ({events})",
                f"{parts['ledger'] / 1000:,.1f}",
                f"{(parts['header'] + parts['other']) / 1000:,.1f}",
                f"{per_run / max(1, stored):.2f}x",
                "none: for sizing",
            ]
        )
    table(
        "footprint: Redis memory a finished run holds until its retention ends",
        [
            "runs of",
            "KB a run",
            "KB a turn",
            "conversation bytes KB",
            "messages KB",
            "events KB (entries)",
            "ledger KB",
            "header + rest KB",
            "x its conversation",
            "target",
        ],
        rows,
        (
            (
                f"KB a run: what the keys hold after {runs} runs less before (MEMORY USAGE of every key, and the "
                "keyspace's tables), divided by them (their keys and their entries in the pool's indexes); the "
                "parts: MEMORY USAGE of one run's keys; conversation bytes: its messages as stored (msgpack); the "
                f"event stream keeps at most about {MAX_EVENTS} entries"
            ),
            (
                "Redis holds about (runs finished a day) x (retention days, 7 by default) x (KB a run), plus the "
                "runs in flight"
            ),
        ),
    )
