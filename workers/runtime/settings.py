"""Settings read once from the environment. The store takes explicit arguments, never these."""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from redis import ConnectionPool, Redis
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url
from redis.exceptions import AuthenticationError, ConnectionError, TimeoutError

from agentpool import webhooks
from agentpool.checks import limit_value
from agentpool.runtime import connections, egress, sentinel
from agentpool.store import crypto
from agentpool.store.errors import AgentPoolError, RedisUnreachable
from agentpool.store.ratelimit import parse_limits

DEFAULT_REDIS_URL = "redis://localhost:6379/0"


def env_number(name: str, default: float, *, zero_ok: bool = False) -> float:
    """The number in the environment variable ``name`` (``default`` when unset or empty); a
    ``ValueError`` naming it when it is not a finite number > 0 (>= 0 with ``zero_ok``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return limit_value(name, float(raw), zero_ok=zero_ok)
    except ValueError:
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {raw!r}") from None


def _env_float(name: str, default: float, *, zero_ok: bool = False) -> float:
    """:func:`env_number` for a worker's settings: a bad one stops the start with its message."""
    try:
        return env_number(name, default, zero_ok=zero_ok)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _replica_acks() -> str:
    raw = os.environ.get("AGENTPOOL_REPLICA_ACKS", "").strip().lower() or "auto"
    if raw != "auto" and not (raw.isdigit() and int(raw) < 100):
        raise SystemExit(f"AGENTPOOL_REPLICA_ACKS must be auto or a number of replicas, got {raw!r}")
    return raw


def _setting(name: str, parse: Callable[[str], Any], empty: Any) -> Any:
    """The setting ``name`` as ``parse`` reads it, ``empty`` when it is unset or blank: a bad one stops
    the start with ``parse``'s one-line message."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return empty
    try:
        return parse(raw)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _webhook_events(raw: str) -> tuple[str, ...]:
    return webhooks.check_events([e.strip() for e in raw.split(",")], subject="AGENTPOOL_WEBHOOK_EVENTS")


def _shards() -> tuple[str, ...]:
    from agentpool.runtime.shards import env_urls

    try:
        return env_urls()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name, "").strip().lower() or default
    if raw not in allowed:
        raise SystemExit(f"{name} must be one of {', '.join(allowed)}, got {raw!r}")
    return raw


@dataclass(frozen=True)
class Settings:
    redis_url: str
    lease_ttl: float  # seconds a turn's lease lives without a heartbeat
    turn_timeout: float  # a forking worker's hard limit on one turn (RQ's job timeout)
    reaper_interval: float
    model_retries: int  # consecutive transient model errors before a run is stopped
    retention: int  # seconds a finished run is kept; 0 keeps it forever
    # Seconds added to a tool's timeout before a takeover repeats or verifies a call that another worker
    # started and may still be running (clock skew between machines, scheduling delays).
    takeover_margin: float = 5.0
    # Tool threads abandoned after their timeout and still running that make a threaded worker process
    # recycle itself (warm: its turns finish, then a fresh process takes its place).
    max_abandoned_tools: int = 4
    model_idle_timeout: float = 120.0  # longest silence allowed between a streamed call's events
    model_call_timeout: float = 600.0  # cap on a whole model call, streamed or not
    model_streaming: bool = True  # False: one non-streaming create() per call (no live output)
    agent_load_grace: float = 300.0  # seconds no worker could load a run's agent before the run stops
    # No tool runs longer than this in this worker, whatever its own timeout (None: no cap). For tests: a
    # takeover waits for an earlier attempt up to its timeout + takeover_margin before it repeats or verifies it.
    max_tool_timeout: float | None = None
    # The durability guard before a tool whose effect is not read (agentpool.runtime.durability):
    # "auto" (1 replica behind Sentinel or on a primary that has replicas, else 0) or a number.
    replica_acks: str = "auto"
    replica_ack_timeout: float = 1.0  # seconds WAIT/WAITAOF may take before the turn is handed back
    waitaof: str = "off"  # off | local | replicas
    # Seconds a Redis command may go unanswered before its connection is dropped and the command re-sent
    # on a new one (agentpool.runtime.connections: a peer gone silent, without FIN or RST).
    redis_timeout: float = 5.0
    # The pool's model rate limits (agentpool.runtime.ratelimit): on by default, learned from the API's
    # headers; AGENTPOOL_RATE_LIMITS sets or caps them per model; the minute can be scaled for tests.
    rate_limiter: bool = True
    rate_limits: dict = field(default_factory=dict)  # model (or "*") -> agentpool.store.ratelimit.Limits
    rate_limit_minute: float = 60.0
    # AGENTPOOL_SHARDS: the Redis URLs of a pool spread over several shards (agentpool.runtime.shards); empty:
    # one Redis, REDIS_URL's. A worker serves some of them; the pool's rate limits are split among them all.
    shards: tuple[str, ...] = ()
    # Completion webhooks (agentpool.webhooks, agentpool.runtime.webhook_delivery): the pool's default URL
    # (every run without a webhook of its own), the events it wants, the signing secret (never shown),
    # the timeout of one attempt, how long a delivery is retried before it is given up, and the addresses
    # a delivery may connect to (agentpool.runtime.egress).
    webhook_url: str = ""
    webhook_events: tuple[str, ...] = ("ended",)
    webhook_secret: str = field(default="", repr=False)
    webhook_timeout: float = 10.0
    webhook_max_age: float = 86400.0
    webhook_networks: egress.Networks = field(default_factory=egress.Networks)
    # Seconds between a worker process's flushes of the pool-wide counters and of the rate-limit settles
    # that may wait (agentpool.runtime.stats_flush): what a worker killed outright loses at most.
    flush_interval: float = 1.0
    # Seconds to start (or reach) an MCP server, initialize its session and list its tools
    # (agentpool.runtime.mcp_hub).
    mcp_connect_timeout: float = 30.0

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            redis_url=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
            lease_ttl=_env_float("AGENTPOOL_LEASE_TTL", 15.0),
            turn_timeout=_env_float("AGENTPOOL_TURN_TIMEOUT", 3600.0),
            reaper_interval=_env_float("AGENTPOOL_REAPER_INTERVAL", 1.0, zero_ok=True),  # 0: no reaper thread
            flush_interval=_env_float("AGENTPOOL_FLUSH_INTERVAL", 1.0),
            mcp_connect_timeout=_env_float("AGENTPOOL_MCP_CONNECT_TIMEOUT", 30.0),
            model_retries=int(_env_float("AGENTPOOL_MODEL_RETRIES", 6, zero_ok=True)),
            retention=int(_env_float("AGENTPOOL_RETENTION_SECONDS", 7 * 24 * 3600, zero_ok=True)),
            takeover_margin=_env_float("AGENTPOOL_TAKEOVER_MARGIN", 5.0, zero_ok=True),
            max_abandoned_tools=max(1, int(_env_float("AGENTPOOL_MAX_ABANDONED_TOOLS", 4))),
            model_idle_timeout=_env_float("AGENTPOOL_MODEL_TIMEOUT", 120.0),
            model_call_timeout=_env_float("AGENTPOOL_MODEL_CALL_TIMEOUT", 600.0),
            model_streaming=os.environ.get("AGENTPOOL_MODEL_STREAMING", "1").strip().lower()
            not in ("0", "false", "no"),
            agent_load_grace=_env_float("AGENTPOOL_AGENT_LOAD_GRACE", 300.0),
            max_tool_timeout=_env_float("AGENTPOOL_MAX_TOOL_TIMEOUT", 0.0, zero_ok=True) or None,
            replica_acks=_replica_acks(),
            replica_ack_timeout=_env_float("AGENTPOOL_REPLICA_ACK_TIMEOUT", 1.0),
            waitaof=_choice("AGENTPOOL_WAITAOF", ("off", "local", "replicas"), "off"),
            redis_timeout=_env_float("AGENTPOOL_REDIS_TIMEOUT", 5.0),
            rate_limiter=_choice("AGENTPOOL_RATE_LIMITER", ("on", "off"), "on") == "on",
            rate_limits=_setting("AGENTPOOL_RATE_LIMITS", parse_limits, {}),
            rate_limit_minute=_env_float("AGENTPOOL_RATE_LIMIT_MINUTE", 60.0),
            shards=_shards(),
            webhook_url=_setting(
                "AGENTPOOL_WEBHOOK_URL", functools.partial(webhooks.check_url, subject="AGENTPOOL_WEBHOOK_URL"), ""
            ),
            webhook_events=_setting("AGENTPOOL_WEBHOOK_EVENTS", _webhook_events, ("ended",)),
            webhook_secret=_setting("AGENTPOOL_WEBHOOK_SECRET", webhooks.check_secret, ""),
            webhook_timeout=_env_float("AGENTPOOL_WEBHOOK_TIMEOUT", 10.0),
            webhook_max_age=_env_float("AGENTPOOL_WEBHOOK_MAX_AGE", 86400.0),
            webhook_networks=_setting(egress.SETTING, egress.parse, egress.Networks()),
        )

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.lease_ttl * 1000)

    @property
    def pool_webhook(self) -> str:
        """The events the pool's default webhook wants, as the status-changing scripts take them ('' for
        no default: only runs with a webhook of their own are posted)."""
        return ",".join(self.webhook_events) if self.webhook_url else ""

    def check_worker(self) -> None:
        """A worker refuses to start, in one line, with settings only a worker needs and lacks: a pool
        default webhook it could not sign, or whose address its own AGENTPOOL_WEBHOOK_NETWORKS refuses
        (an address written in the URL; a name is resolved, and checked, at each delivery)."""
        if self.webhook_url and not self.webhook_secret:
            raise SystemExit(
                "AGENTPOOL_WEBHOOK_URL is set but AGENTPOOL_WEBHOOK_SECRET is not: webhooks are signed with "
                "it; set the same secret on every worker (agentpool genkey prints one)"
            )
        if self.webhook_url:
            try:
                self.webhook_networks.check_url(self.webhook_url)
            except egress.AddressRefused as exc:
                raise SystemExit(f"AGENTPOOL_WEBHOOK_URL: {exc}") from None


def configure_encryption() -> None:
    """Encryption at rest from AGENTPOOL_ENCRYPTION_KEY (encrypts and decrypts) and
    AGENTPOOL_ENCRYPTION_OLD_KEYS (comma-separated, decrypt only: keys being rotated out)."""
    key = os.environ.get("AGENTPOOL_ENCRYPTION_KEY", "").strip()
    old = [k.strip() for k in os.environ.get("AGENTPOOL_ENCRYPTION_OLD_KEYS", "").split(",") if k.strip()]
    if not key and old:
        raise SystemExit("AGENTPOOL_ENCRYPTION_OLD_KEYS is set without AGENTPOOL_ENCRYPTION_KEY")
    try:
        crypto.configure(crypto.Cipher([key, *old]) if key else None)
    except ValueError as exc:
        raise SystemExit(f"AGENTPOOL_ENCRYPTION_KEY: {exc}") from None


configure_encryption()


URL_FORM = (
    "expected redis://[user:password@]host:port/db, rediss://… (TLS), unix:///path/to/redis.sock or "
    + sentinel.SENTINEL_FORM
)
# Query options whose values a redacted URL shows; any other's (a password, a misspelt one) is hidden.
SHOWN_QUERY_OPTIONS = frozenset(
    {"sentinel_username", "db", "protocol", "client_name", "ssl_cert_reqs", "socket_timeout", "socket_connect_timeout"}
)
# Names a redacted URL shows (with the value hidden unless it is one of those above): ours and redis-py's.
KNOWN_QUERY_OPTIONS = SHOWN_QUERY_OPTIONS | set(sentinel.QUERY_OPTIONS) | set(URL_QUERY_ARGUMENT_PARSERS) | {"password"}


class BadRedisUrl(ValueError):
    """A Redis URL redis-py cannot use; the message names the expected form, never the password."""


def check_redis_url(url: str, *, subject: str = "the Redis URL") -> str:
    """``url`` if redis-py can connect with it; otherwise a :class:`BadRedisUrl` saying what is expected."""
    try:
        if sentinel.is_sentinel(url):
            sentinel.parse(url)  # its messages never quote the URL
        else:
            parse_url(url)
    except ValueError as exc:
        # redis-py's own message quotes pieces of the URL (the text before a "/" or "?" in a password
        # that was not percent-encoded), so only ours are passed on.
        if sentinel.is_sentinel(url):
            why = f" ({exc})"
        elif "://" not in url:
            shown = "host:port/0" if "@" in url else url + ("" if "/" in url else "/0")  # never echo a password
            why = f" (no scheme: write redis://{shown})"
        elif "@" in url:
            why = " (a password holding / ? # @ must be percent-encoded)"
        else:
            why = ""
        raise BadRedisUrl(f"{subject} is not a Redis URL: {redact_url(url)!r}{why}; {URL_FORM}") from None
    return url


def connect(url: str | None = None, *, max_connections: int | None = None) -> Redis:
    """A client that rides out a dropped connection or a Redis restart (~15 s of retries) instead of
    failing the turn, and gives up on a connection gone silent after ``AGENTPOOL_REDIS_TIMEOUT``
    (``agentpool.runtime.connections``). Bytes in, bytes out: RQ requires ``decode_responses=False``.

    ``max_connections`` is for a process of many threads (``worker --concurrency N``): its threads
    share that many connections and wait up to 30 s for a free one. redis-py's default pool holds 100
    and fails the 101st caller at once (``MaxConnectionsError``)."""
    url = check_redis_url(url or Settings.from_env().redis_url, subject="REDIS_URL" if url is None else "the Redis URL")
    # A Sentinel URL gets a pool per process that asks the sentinels where the primary is: it follows a failover.
    return connections.build(url, retry=connections.ride_out(), max_connections=max_connections)


def redact_url(url: str) -> str:
    """The URL without its passwords, for logs, banners and error messages. A lone credential before
    ``@`` (``redis://secret@host``) is taken for a password too; an ACL user name is kept; a query
    option's value is shown only for the harmless ones (``SHOWN_QUERY_OPTIONS``): a password there
    (``?password=``, ``?sentinel_password=``), even misspelt, is not, and an option name that is not
    known is hidden too (it may be the end of a password holding an unencoded "&").

    The credentials end at the last "@", looked for before the query: a password that was not
    percent-encoded may hold "?", "/" or "#", and must not be mistaken for a path or a query."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        creds, _, rest = rest.rpartition("@")
        user, colon, _password = creds.partition(":")
        shown = f"{user}:***@" if colon and user and "/" not in user and "?" not in user else "***@"
    else:
        shown = ""
    rest, mark, query = rest.partition("?")
    if mark:
        options = [option.partition("=") for option in query.split("&")]
        query = "&".join(
            f"{k}{eq}{v if k in SHOWN_QUERY_OPTIONS else '***'}" if k in KNOWN_QUERY_OPTIONS else "***"
            for k, eq, v in options
        )
    return f"{scheme}{sep}{shown}{rest}{mark}{query}"


# A bytes client per connection pool of the decode_responses=True clients apps hand us.
_bytes_clients: weakref.WeakKeyDictionary[ConnectionPool, Redis] = weakref.WeakKeyDictionary()


_warned_default = False
_url_clients: dict[str, Redis] = {}  # one client (and connection pool) per URL an app passes as connection=


def client_for(connection: Redis | str | None) -> Redis:
    """The client to use: agentpool reads Redis as bytes (msgpack records, and RQ requires it). A client
    made with ``decode_responses=True`` is accepted: a bytes client with the same connection settings
    is built from its pool once and reused. A URL (``"redis://host:6379/0"``) gets a client of its own;
    None, the one ``REDIS_URL`` names (the default URL, said once in a warning, when it is not set)."""
    global _warned_default
    if isinstance(connection, str):
        client = _url_clients.get(connection)
        if client is None:
            client = _url_clients[connection] = connect(connection)
        return client
    if connection is None:
        if not os.environ.get("REDIS_URL") and not _warned_default:
            _warned_default = True
            warnings.warn(
                f"agentpool: no connection given and REDIS_URL is not set: using {DEFAULT_REDIS_URL}",
                stacklevel=3,
            )
        return connect()
    # Duck-typed: agentpool.aio hands the sync code a redis.asyncio client seen as a sync one (GreenRedis).
    if not hasattr(connection, "connection_pool"):
        raise TypeError(
            f"connection must be a redis.Redis client or a Redis URL string, got {type(connection).__name__}"
        )
    pool = connection.connection_pool
    if not pool.connection_kwargs.get("decode_responses"):
        return connection
    client = _bytes_clients.get(pool)
    if client is not None:
        return client
    try:
        client = connections.derive(connection, decode_responses=False)
    except TypeError:
        raise AgentPoolError(
            f"agentpool reads Redis as bytes, as RQ does, and cannot derive a bytes client from this "
            f"decode_responses=True client ({type(pool).__name__}); pass one made without decode_responses=True"
        ) from None
    _bytes_clients[pool] = client
    return client


P = ParamSpec("P")
T = TypeVar("T")


class RedisCredentialsRefused(RedisUnreachable, AuthenticationError):
    """Redis refused the password or user an API call connected with; the message names the server
    (without its password). Raised at once: retrying cannot fix credentials. A
    :class:`RedisUnreachable` still (Redis cannot be used from here, as before), and redis-py's
    ``AuthenticationError``."""

    @classmethod
    def at(cls, where: str, exc: BaseException) -> RedisCredentialsRefused:
        """The error for the server (or shard) named ``where``, from redis-py's refusal ``exc``."""
        return cls(f"Redis at {where} refused the credentials: {exc}")


def names_the_server(fn: Callable[P, T]) -> Callable[P, T]:
    """For the API's functions: a Redis that cannot be reached is a :class:`RedisUnreachable` naming
    the server it tried (``connection=``'s, else ``REDIS_URL``'s, without a password), not redis-py's
    bare ``ConnectionError``; one that refuses the credentials, a :class:`RedisCredentialsRefused`."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except RedisUnreachable:
            raise
        except AuthenticationError as exc:  # before ConnectionError, its base: it is not a dropped connection
            server = server_of(kwargs.get("connection"))
            raise RedisCredentialsRefused.at(server, exc) from exc
        except (ConnectionError, TimeoutError) as exc:
            raise RedisUnreachable(f"Redis unreachable at {server_of(kwargs.get('connection'))}: {exc}") from exc

    return call


def server_of(connection: Any) -> str:
    """Where a client (or URL, or None: ``REDIS_URL``, or shards) connects, without credentials."""
    servers = getattr(connection, "servers", None)  # agentpool.runtime.shards.Shards
    if callable(servers):
        return str(servers())
    if connection is None and os.environ.get("AGENTPOOL_SHARDS", "").strip():
        from agentpool.runtime.shards import from_env

        return server_of(from_env())
    if connection is None:
        url = os.environ.get("REDIS_URL")
        return (
            f"{redact_url(url)} (from REDIS_URL)" if url else f"{DEFAULT_REDIS_URL} (the default: REDIS_URL is not set)"
        )
    if isinstance(connection, str):
        return redact_url(connection)
    pool = getattr(connection, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {})
    manager = getattr(pool, "sentinel_manager", None)  # a Sentinel client (redis.sentinel or redis.asyncio's)
    if manager is not None:  # named as its URL names it: the primary's address changes with a failover
        sentinels = ",".join(
            f"{s.connection_pool.connection_kwargs.get('host')}:{s.connection_pool.connection_kwargs.get('port')}"
            for s in manager.sentinels
        )
        return f"redis+sentinel://{sentinels}/{pool.service_name}/{kwargs.get('db', 0)}"
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    if "host" in kwargs:
        return f"redis://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return type(connection).__name__
