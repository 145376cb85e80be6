"""A pool over several Redis shards (docs/sharding.md): each shard is a complete agentpool + RQ deployment
on a primary of its own (a Sentinel group if you like), and a run lives on one shard for its whole life.
This module is the routing layer above the store, which stays a one-Redis store.

- ``AGENTPOOL_SHARDS``: the shards' Redis URLs (any form ``REDIS_URL`` takes), separated by spaces,
  shard 0 first. The order numbers the shards: a list only ever grows at its end.
- ``Shards([...])``: the same as a ``connection=`` for the API (clients or URLs).
- Where a run lives: an id ending in ``-s<N>`` (every id agentpool makes on a sharded pool; a child run's
  id keeps its parent's ending) lives on shard N; any other id (one an app gave, ``"order-1234"``) on the
  shard a rendezvous hash of the id picks, so adding a shard moves only the ids the new shard wins. A
  reader asks that shard first and then each other one, so a run is found wherever it is: created before
  a shard was added, or a fork given an id of the caller's (a fork stays on its parent's shard).
- New runs without an id go round the shards in turn (from a random start in each process); the runs
  of one concurrency key all go to the shard the key hashes to, so that its cap holds exactly.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
import secrets
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from redis import Redis
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, TimeoutError

from agentpool.runtime.settings import (
    BadRedisUrl,
    RedisCredentialsRefused,
    check_redis_url,
    client_for,
    redact_url,
    server_of,
)
from agentpool.store.errors import RedisUnreachable, RunExists
from agentpool.store.keys import RunKeys, tagged_shard

T = TypeVar("T")

ENV = "AGENTPOOL_SHARDS"
MAX_SHARDS = 1000  # the id ending holds up to three digits
ID_CLAIM_SECONDS = 3600  # how long an id of the caller's stays taken for the shard it was first created on
FORM = f"{ENV} is the shards' Redis URLs separated by spaces, shard 0 first: redis://a:6379/0 redis://b:6379/0"
_GLUED = re.compile(r",\s*(rediss?|unix|rediss?\+sentinel)://", re.IGNORECASE)


class BadShards(BadRedisUrl):
    """A shard list agentpool cannot use; the message names the shard and never holds a password."""


def parse(raw: str, *, origin: str = ENV) -> tuple[str, ...]:
    """The URLs of a shard list (empty: no shards), each checked; a :class:`BadShards` otherwise."""
    urls = tuple(raw.split())
    check_urls(dict(enumerate(urls)), origin=origin)
    return urls


def env_urls() -> tuple[str, ...]:
    """``AGENTPOOL_SHARDS``'s URLs, checked (empty when it is not set); each value is parsed once."""
    return _parse_env(os.environ.get(ENV, ""))


@functools.lru_cache(maxsize=8)
def _parse_env(raw: str) -> tuple[str, ...]:
    return parse(raw)  # a bad list raises each time: lru_cache keeps only results


def check_urls(urls: dict[int, str], *, origin: str) -> None:
    """Each shard's URL (shard number -> URL) usable and none twice; a one-line :class:`BadShards` otherwise."""
    if len(urls) > MAX_SHARDS:
        raise BadShards(f"{origin}: {len(urls)} shards; at most {MAX_SHARDS}")
    seen: dict[str, int] = {}
    for i, url in urls.items():
        if _GLUED.search(url):
            raise BadShards(
                f"{origin}: separate the shards' URLs with spaces, not commas (a Sentinel URL holds commas of "
                f"its own); {FORM}"
            )
        try:
            check_redis_url(url, subject=f"shard {i} of {origin}")
        except BadRedisUrl as exc:
            raise BadShards(str(exc)) from None
        if url in seen:
            raise BadShards(
                f"{origin}: shard {i} is shard {seen[url]} again ({redact_url(url)}); each shard is a Redis of its own"
            )
        seen[url] = i


def rendezvous(name: str, n: int) -> int:
    """The shard ``name`` hashes to among ``n``: the one with the highest hash of (shard, name). Adding a
    shard moves only the names the new shard wins (1 in n+1), the others stay where they were."""
    return max(range(n), key=lambda i: hashlib.blake2b(f"{i}\0{name}".encode(), digest_size=8).digest())


def rule(run_id: str, n: int) -> int:
    """The shard a run with this id is created on (and first looked for): its ``-s<N>`` ending's, or its hash's."""
    tagged = tagged_shard(run_id)
    return tagged if tagged is not None and tagged < n else rendezvous(run_id, n)


class Shards:
    """Several Redis shards as one pool, for ``connection=`` of every API call (``agentpool.Shards``)::

        pool = Shards(["redis://a:6379/0", "redis://b:6379/0"])   # or Redis clients; shard 0 first
        run_id = enqueue_run("myapp.agents:support", "...", connection=pool)
        run = wait_for_run(run_id, connection=pool)

    Without ``connection=``, the API uses ``AGENTPOOL_SHARDS`` when it is set (else ``REDIS_URL``)."""

    def __init__(self, shards: Iterable[Redis | str], *, origin: str = "Shards") -> None:
        if isinstance(shards, (str, bytes)):
            raise TypeError("Shards takes a list of Redis clients or URLs, one per shard, not one string")
        members = list(shards)
        if not members:
            raise ValueError(f"{origin}: no shard given")
        check_urls({i: m for i, m in enumerate(members) if isinstance(m, str)}, origin=origin)
        for i, member in enumerate(members):
            if not isinstance(member, str) and not hasattr(member, "connection_pool"):
                raise TypeError(f"{origin}: shard {i} is a {type(member).__name__}, not a Redis client or a URL")
        self.members = tuple(members)
        self.origin = origin
        self.clients = [client_for(m) for m in members]
        self.names = [redact_url(m) if isinstance(m, str) else server_of(m) for m in members]
        self._next = itertools.count(secrets.randbelow(len(members)))

    def __len__(self) -> int:
        return len(self.clients)

    def __iter__(self) -> Iterator[Redis]:
        return iter(self.clients)

    def __repr__(self) -> str:
        return f"Shards([{', '.join(self.names)}])"

    def name(self, shard: int) -> str:
        return f"shard {shard} ({self.names[shard]})"

    def servers(self) -> str:
        """Every shard, without passwords, for an error message."""
        source = f" (from {ENV})" if self.origin == ENV else ""
        return f"one of the shards {', '.join(self.names)}{source}"

    def locate(self, run_id: str) -> int:
        """The shard holding ``run_id``, or its rule's shard when no shard has it (the caller then finds
        no run there and says so)."""
        if len(self) == 1:
            return 0
        found = self.find(run_id)
        return rule(run_id, len(self)) if found is None else found

    def find(self, run_id: str) -> int | None:
        """The shard holding ``run_id`` (its rule's shard asked first, then each other), or None.

        A shard that does not answer is passed over, so a run is found on the shards that do. Only when
        none of them has it is that a :class:`RedisUnreachable` naming the silent shard, as the run may
        be there: never "no such run", and never a second run made by an enqueue of the same id. A shard
        that refuses the credentials is a :class:`RedisCredentialsRefused` naming it, at once."""
        first = rule(run_id, len(self))
        key = RunKeys.of(run_id).run
        silent: tuple[int, RedisError] | None = None  # the first shard that did not answer
        for shard in (first, *(i for i in range(len(self)) if i != first)):
            try:
                if self.clients[shard].exists(key):
                    return shard
            except AuthenticationError as exc:  # a ConnectionError to redis-py, but a wrong password, no outage
                refused = RedisCredentialsRefused.at(self.name(shard), exc)
                refused.shard = shard
                raise refused from exc
            except (ConnectionError, TimeoutError) as exc:
                silent = silent or (shard, exc)
        if silent:
            shard, exc = silent
            unreachable = RedisUnreachable(
                f"Redis unreachable at {self.name(shard)}, which may hold run {run_id}: {exc}"
            )
            unreachable.shard = shard
            raise unreachable from exc
        return None

    def claim(self, run_id: str, shard: int) -> None:
        """Before a run with an id of the caller's, found on no shard, is created on ``shard``: the id is
        taken for that shard on the id's rule shard (``SET NX``), so that two requests racing to create it on two shards (two
        concurrency keys, a fork of a parent on another shard, a shard that was down when one of them
        looked) cannot both make it: the one that comes second gets :class:`RunExists` naming where it
        is made; a request for the same shard goes on, and its shard's own transaction decides (a retry
        returns the run it made). The claim only has to outlive the race: after ``ID_CLAIM_SECONDS``
        a creator finds the run itself (``find``)."""
        key = RunKeys.of(run_id).home
        client = self.clients[rule(run_id, len(self))]
        if client.set(key, shard, nx=True, ex=ID_CLAIM_SECONDS):
            return
        claimed = client.get(key)
        if claimed is not None and int(claimed) != shard:
            raise RunExists(run_id, f"or is being created, on {self.name(int(claimed))}")
        if claimed is None:  # the claim expired between the two commands: take it again
            self.claim(run_id, shard)

    def for_new_run(self, run_id: str | None, concurrency_key: str | None = None) -> int:
        """The shard a new run goes to: where an id the caller gave lives already (its enqueue is then
        idempotent as on one Redis); else a concurrency key's own shard, whatever the id (the key's
        cap is counted on that shard, so its runs must not spread); else the id's rule's shard, or the
        next in turn. A reader finds an id placed by its key as any other: on a shard asked after the
        id's own."""
        if len(self) == 1:
            return 0
        if run_id is None:
            return next(self._next) % len(self) if concurrency_key is None else self._key_shard(concurrency_key)
        shard = self.find(run_id)
        if shard is not None:
            return shard  # it exists: its shard's own transaction decides (the same request, or RunExists)
        shard = rule(run_id, len(self)) if concurrency_key is None else self._key_shard(concurrency_key)
        self.claim(run_id, shard)
        return shard

    def _key_shard(self, concurrency_key: str) -> int:
        return rendezvous(f"ckey:{concurrency_key}", len(self))


_from_env: dict[tuple[str, ...], Shards] = {}


def from_env() -> Shards | None:
    """The pool ``AGENTPOOL_SHARDS`` names (one per process), or None when it is not set."""
    urls = env_urls()
    if not urls:
        return None
    shards = _from_env.get(urls)
    if shards is None:
        shards = _from_env[urls] = Shards(urls, origin=ENV)
    return shards


def pool_of(connection: Any) -> Shards | None:
    """The shards a ``connection=`` names: itself if it is a :class:`Shards`, ``AGENTPOOL_SHARDS``'s for
    None; None for one Redis (a client or a URL)."""
    if isinstance(connection, Shards):
        return connection
    return from_env() if connection is None else None


def located(connection: Any, run_id: str) -> tuple[Redis, int | None]:
    """The client of the Redis holding ``run_id`` and its shard number (None: not a sharded pool)."""
    shards = pool_of(connection)
    if shards is None:
        return client_for(connection), None
    shard = shards.locate(run_id)
    return shards.clients[shard], shard


def route(connection: Any, run_id: str) -> Redis:
    """The client of the Redis holding ``run_id``: ``connection``'s own, or on a sharded pool its shard's."""
    return located(connection, run_id)[0]


def home(connection: Any, run_id: str | None, concurrency_key: str | None = None) -> tuple[Redis, int | None]:
    """Where a new run goes (``Shards.for_new_run``) and its shard number (None: not a sharded pool)."""
    shards = pool_of(connection)
    if shards is None:
        return client_for(connection), None
    shard = shards.for_new_run(run_id, concurrency_key)
    return shards.clients[shard], shard


def each_answering(connection: Any, read: Callable[[Redis], T]) -> tuple[list[tuple[int | None, T]], list[str]]:
    """``read`` of every Redis of the pool, with its shard number, and apart the shards that did not
    answer (``shard 1 (host:6379): Connection refused``): a view of the whole pool (``agentpool runs``,
    the dashboard's list) shows what the others hold and says what is missing, where one Redis down
    would otherwise blank it all. One Redis (not a sharded pool) that does not answer raises."""
    shards = pool_of(connection)
    if shards is None:
        return [(None, read(client_for(connection)))], []
    answers: list[tuple[int | None, T]] = []
    silent: list[str] = []
    for shard, outcome in enumerate(on_every_shard(shards.clients, read)):
        if isinstance(outcome, (ConnectionError, TimeoutError)):
            cause = outcome.__cause__ or outcome  # the API's RedisUnreachable names the server: the shard's name does
            silent.append(f"{shards.name(shard)}: {str(cause).strip() or type(cause).__name__}")
        elif isinstance(outcome, Exception):
            raise outcome
        else:
            answers.append((shard, outcome))
    return answers, silent


def on_every_shard(clients: list[Redis], read: Callable[[Redis], T]) -> list[T | Exception]:
    """``read`` of each client, all at once (a thread each): the answer, or the exception it raised, in
    the clients' order. A shard that does not answer costs its socket timeout (and retries) once, not
    once per shard before it, so a view of the pool (a metrics scrape, within Prometheus's timeout)
    takes as long as its slowest shard, not their sum."""
    if len(clients) == 1:
        return [_outcome(read, clients[0])]
    with ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="agentpool-shard") as pool:
        return list(pool.map(functools.partial(_outcome, read), clients))


def _outcome(read: Callable[[Redis], T], client: Redis) -> T | Exception:
    try:
        return read(client)
    except Exception as exc:  # noqa: BLE001 - returned: the caller tells a silent shard from a bug
        return exc


def each(connection: Any) -> list[tuple[int | None, Redis]]:
    """Every Redis of the pool with its shard number (one Redis: ``[(None, client)]``), for readers that
    look at all runs (``list_runs``, ``agentpool runs``, metrics, the reaper command)."""
    shards = pool_of(connection)
    if shards is None:
        return [(None, client_for(connection))]
    return list(enumerate(shards.clients))
