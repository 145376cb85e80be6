"""Every Redis key agentpool uses is built here; this docstring is the data-layout map.

Per run (all keys of a run share the hash tag ``{run:<id>}``)::

    ap:{run:<id>}:run       hash    header: v (schema), agent, status, turns, phase, pending,
                                    fence, attempt, token counters, limits, error, result, times;
                                    a sub-agent's parent, ancestors and depth; tree_* counters (the
                                    spend of the runs below, added live) and cap_* (its tree's budget)
    ap:{run:<id>}:messages  list    one msgpack blob per message, append-only
    ap:{run:<id>}:lease     string  owner token "<fence>:<worker>", with a TTL
    ap:{run:<id>}:ledger    hash    "<tool_use_id>" -> intent record, "<tool_use_id>:out" -> outcome record
    ap:{run:<id>}:events    stream  progress events, capped
    ap:{run:<id>}:approvals hash    "<tool_use_id>" -> a person's decision, "<tool_use_id>:wait" -> the request
    ap:{run:<id>}:live      stream  the model call in flight, as it streams (text, thinking, tool-input deltas),
                                    written only while somebody watches; capped, expires soon after the call
    ap:{run:<id>}:watchers  string  present while somebody watches the run live (each watcher renews its TTL)
    ap:{run:<id>}:handback  hash    why the run's turn was handed back on purpose (a worker without the
                                    key, an agent it cannot import...): reason, detail, worker, since,
                                    count, until, job; kept apart from the header so that a worker
                                    handing back a record too new for it leaves that record untouched
    ap:{run:<id>}:children  list    the run's child runs (sub-agents), in tool_use order, each once
    ap:{run:<id>}:joins     hash    "<child id>" -> "open" while that child runs (or is held by its
                                    tree's budget), "ended" once it has ended, and "<child id>:end" ->
                                    its status then, and "<child id>:late" -> the late answer it gave
                                    (once, after an end without one): the child's terminal write marks
                                    it, and wakes the parent (status waiting_children) when it was the
                                    last open one
    ap:{run:<id>}:inbox     list    ids of the messages sent to the run (``send_message``) that wait for
                                    delivery at its next turn boundary, oldest first
    ap:{run:<id>}:received  hash    "<message_id>" -> the message as sent (sealed like the conversation),
                                    "<message_id>:at" -> "<turns>:<index>" once delivered: the run's turn
                                    count then, and the message's index in the conversation
    ap:{run:<id>}:webhooks  hash    the run's completion webhook deliveries, numbered n = 1, 2... (one per
                                    end, or wait for a person, that a webhook wants): "<n>" -> the run's
                                    summary then (msgpack), "<n>:result" -> the start of its result,
                                    "<n>:state" pending | delivered | undelivered, "<n>:attempts",
                                    "<n>:claim" (the worker delivering it), "<n>:error" (the last
                                    failure), "<n>:at" (last attempt, ms), "<n>:next" (next try, ms),
                                    "<n>:done" (delivered or given up, ms), "<n>:waiting" (why nobody
                                    delivers it); written by the status change
                                    itself (store/lua/_webhook.lua), expires with the run

Global::

    ap:runs                 zset    run id -> created-at (ms); the listing behind `agentpool runs`;
                                    the ids of expired runs are swept out by the reaper
    ap:runs:sweep           string  where that sweep goes on (a ZSCAN cursor)
    ap:runs:sweep:pass      string  when its last pass over the index began (ms): a pass begins at
                                    most every 10 minutes
    ap:runs:watch           zset    run id -> when the reaper should next look at it (ms); holds
                                    every run that is queued or running (and one waiting for an
                                    approval with a deadline); changed only by scripts or
                                    transactions that check the status it was decided from
    ap:turns:deferred       zset    "<run id>:<turn>:<re-enqueue n>" -> when that turn is due (ms): a
                                    turn deferred after a model error; not an RQ job until due, when
                                    the reaper moves it onto the queue as job ``<run>-t<turn>-r<n>``
    ap:reaper:lock          string  held by the one worker that scans this second
    ap:stranded             hash    job id -> when the reaper first saw it in an RQ intermediate list
                                    (ms, Redis's clock): a job dequeued and never claimed is given
                                    back once listed there 10 s; a job no longer listed is dropped
    ap:watching             string  present while somebody watches any run live (every watcher renews
                                    it with the run's own ``watchers``): while it is absent a turn
                                    does not look at its run's (store/live.py)
    ap:durability:probe     string  a counter the durability guard increments before WAIT, so that
                                    WAIT has a write of its own connection to wait for
    ap:stats                hash    pool-wide counters behind /metrics (see store/stats.py); a worker
                                    process adds what it counted about once a second
    ap:stats:flush:<id>     string  marks one such flush as added (so a re-sent flush adds nothing);
                                    expires after a minute
    ap:webhooks:due         zset    delivery id "<run id>.<created ms>.<n>" -> when it is due (ms): every
                                    webhook delivery not yet made; a worker claiming one pushes it a lease
                                    ahead (a worker killed while delivering leaves it due again); dropped
                                    once delivered, given up or its run expired

Per model's rate-limit budget (all keys of one budget share the hash tag ``{limits:<model>}``)::

    ap:{limits:<m>}:budget  hash    the pool's token buckets for the model: "level:<dim>" (requests,
                                    input, output), "at" (ms of the last refill), "learned:<dim>" (the
                                    limit the API's anthropic-ratelimit-* headers reported),
                                    "started:<dim>" and "started:at" (the calls started while nothing
                                    limited the model: what they started, when the last one did),
                                    "headerless" (its replies carry no rate-limit headers), "swept"
                                    (ms: when dead reservations were last dropped from the held hash)
    ap:{limits:<m>}:held    hash    reservation id -> "<input> <output> <ms>": calls in flight (an hour
                                    old: its worker died, dropped within 10 minutes); a call
                                    started while nothing limited the model (no budget taken): "<input>
                                    <output> <ms> <requests> <started:requests> <started:input>
                                    <started:output>" until it settles, a minute after it started at most
    ap:{limits:<m>}:waiting zset    ticket "<run id>:<turn>" -> when it began to wait (ms): the line
    ap:{limits:<m>}:needs   hash    ticket -> "<requests> <input> <output> <expires ms>"
    ap:limits:models        set     every model that has a budget (for ``agentpool limits show``)

Per concurrency key (``enqueue_run(..., concurrency_key=...)``; hash tag ``{ckey:<key>}``)::

    ap:{ckey:<k>}:slots     zset    run id -> since (ms): the runs of the key with a turn in flight; a
                                    member whose run holds no lease any more is free again
    ap:{ckey:<k>}:waiting   zset    run id -> when it began to wait (ms): the line for a slot
    ap:{ckey:<k>}:wake      hash    run id -> "<expires ms>|<deferred entry>": the waiting turn's entry
                                    in ap:turns:deferred, made due at once when a slot frees
    ap:concurrency:limits   hash    key -> the limit an operator set (``agentpool limits set``): it wins
                                    over the runs' own max_concurrency
    ap:concurrency:keys     set     every concurrency key seen (for ``agentpool limits show``)

RQ keeps its own keys under ``rq:``; agentpool's turn jobs go to the queue named by ``TURN_QUEUE``
(the run's queue ``default``), or ``agentpool-<name>`` for a run enqueued on queue ``<name>`` (its
header's ``queue``): ``rq_queue_name``.
The global keys are touched by the same scripts and transactions as a run's keys (and RQ's enqueue
joins them), so each Redis holding runs is one primary (with replicas, behind Sentinel if you like),
not Redis Cluster. A pool that outgrows one primary spreads its runs over several, each a complete
copy of this layout with its own RQ keys (``AGENTPOOL_SHARDS``, docs/sharding.md): a run and all its
keys live on one shard, which a ``-s<N>`` ending of its id names (``SHARD_TAG``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "ap"
RUNS = f"{PREFIX}:runs"
RUNS_WATCH = f"{PREFIX}:runs:watch"
RUNS_SWEEP = f"{PREFIX}:runs:sweep"
RUNS_SWEEP_PASS = f"{PREFIX}:runs:sweep:pass"
REAPER_LOCK = f"{PREFIX}:reaper:lock"
STRANDED = f"{PREFIX}:stranded"
ANYONE_WATCHING = f"{PREFIX}:watching"
TURNS_DEFERRED = f"{PREFIX}:turns:deferred"
DURABILITY_PROBE = f"{PREFIX}:durability:probe"
STATS = f"{PREFIX}:stats"
WEBHOOKS_DUE = f"{PREFIX}:webhooks:due"
TURN_QUEUE = "agentpool"
DEFAULT_QUEUE = "default"  # a run's queue when none is named: RQ's queue TURN_QUEUE, as before queues
QUEUE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
LIMIT_MODELS = f"{PREFIX}:limits:models"
CONCURRENCY_LIMITS = f"{PREFIX}:concurrency:limits"
CONCURRENCY_KEYS = f"{PREFIX}:concurrency:keys"
CONCURRENCY_KEY = re.compile(r"^[A-Za-z0-9._@-]{1,100}$")
# A model id in a key (and a ticket's text): what the API's ids use, nothing that could break a key.
MODEL_ID = re.compile(r"^[A-Za-z0-9._@/-]{1,200}$")
# A run id is part of RQ job ids (letters, digits, "_" and "-" only) and of the dashboard's URLs.
RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


# A run id ending in "-s<N>" lives on shard N of a sharded pool (agentpool.runtime.shards): the ids
# agentpool makes there carry it, and a child run's id keeps its parent's (store/children.py).
SHARD_TAG = re.compile(r"-s(\d{1,3})$")


def shard_suffix(shard: int) -> str:
    """The ending of an id made for shard ``shard``: ``-s<N>``."""
    return f"-s{shard}"


def shard_tag(run_id: str) -> str:
    """The ``-s<N>`` ending of ``run_id``, or "" when it has none."""
    found = SHARD_TAG.search(run_id)
    return found.group(0) if found else ""


def tagged_shard(run_id: str) -> int | None:
    """The shard number ``run_id``'s ending names, or None."""
    found = SHARD_TAG.search(run_id)
    return int(found.group(1)) if found else None


def check_run_id(run_id: str) -> str:
    """``run_id`` if a run may have it; a ValueError saying what is allowed otherwise."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ValueError(f"a run id is 1 to 100 letters, digits, '_' or '-'; got {run_id!r}")
    return run_id


def check_queue(queue: str) -> str:
    """``queue`` if a run may be put on it; a ValueError saying what is allowed otherwise."""
    if not isinstance(queue, str) or not QUEUE_NAME.match(queue):
        raise ValueError(
            f"a queue name is 1 to 40 lowercase letters, digits, '_' or '-' (starting with a letter or digit); "
            f"got {queue!r}"
        )
    return queue


def stats_flush_key(flush_id: str) -> str:
    """Marks one flush of a process's counters into ``STATS`` as added (``store/lua/stats_flush.lua``)."""
    return f"{STATS}:flush:{flush_id}"


def rq_queue_name(queue: str) -> str:
    """The RQ queue of agentpool's queue ``queue``: ``default`` stays RQ's ``agentpool``."""
    return TURN_QUEUE if queue == DEFAULT_QUEUE else f"{TURN_QUEUE}-{check_queue(queue)}"


@dataclass(frozen=True, slots=True)
class RunKeys:
    run_id: str
    run: str
    messages: str
    lease: str
    ledger: str
    events: str
    approvals: str
    live: str
    watchers: str
    handback: str
    inbox: str
    received: str
    children: str
    joins: str
    webhooks: str
    unleased: str
    call: str
    home: str  # on a sharded pool, on the id's rule shard (not necessarily the run's): see shards.claim

    @classmethod
    def of(cls, run_id: str) -> RunKeys:
        base = f"{PREFIX}:{{run:{run_id}}}"
        return cls(
            run_id=run_id,
            run=f"{base}:run",
            messages=f"{base}:messages",
            lease=f"{base}:lease",
            ledger=f"{base}:ledger",
            events=f"{base}:events",
            approvals=f"{base}:approvals",
            live=f"{base}:live",
            watchers=f"{base}:watchers",
            handback=f"{base}:handback",
            inbox=f"{base}:inbox",
            received=f"{base}:received",
            children=f"{base}:children",
            joins=f"{base}:joins",
            webhooks=f"{base}:webhooks",
            unleased=f"{base}:unleased",
            call=f"{base}:call",
            home=f"{base}:home",
        )

    def all(self) -> tuple[str, ...]:
        return (
            self.run,
            self.messages,
            self.lease,
            self.ledger,
            self.events,
            self.approvals,
            self.live,
            self.watchers,
            self.handback,
            self.inbox,
            self.received,
            self.children,
            self.joins,
            self.webhooks,
            self.unleased,
            self.call,
        )

    def kept(self) -> tuple[str, ...]:
        """The keys that hold a run's data (not its lease): what the retention expires."""
        return (
            self.run,
            self.messages,
            self.ledger,
            self.events,
            self.approvals,
            self.handback,
            self.inbox,
            self.received,
            self.children,
            self.joins,
            self.webhooks,
        )


@dataclass(frozen=True, slots=True)
class LimitKeys:
    model: str
    budget: str
    held: str
    waiting: str
    needs: str

    @classmethod
    def of(cls, model: str) -> LimitKeys:
        if not MODEL_ID.match(model):
            raise ValueError(f"a model id is 1 to 200 letters, digits or ._@/-; got {model!r}")
        base = f"{PREFIX}:{{limits:{model}}}"
        return cls(model, f"{base}:budget", f"{base}:held", f"{base}:waiting", f"{base}:needs")

    def all(self) -> tuple[str, ...]:
        return (self.budget, self.held, self.waiting, self.needs)


def check_concurrency_key(key: str) -> str:
    if not isinstance(key, str) or not CONCURRENCY_KEY.match(key):
        raise ValueError(f"a concurrency key is 1 to 100 letters, digits or ._@-; got {key!r}")
    return key


@dataclass(frozen=True, slots=True)
class ConcurrencyKeys:
    key: str
    slots: str
    waiting: str
    wake: str

    @classmethod
    def of(cls, key: str) -> ConcurrencyKeys:
        base = f"{PREFIX}:{{ckey:{check_concurrency_key(key)}}}"
        return cls(key, f"{base}:slots", f"{base}:waiting", f"{base}:wake")
