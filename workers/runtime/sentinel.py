"""``REDIS_URL`` through Sentinel: ``redis+sentinel://[user:password@]host:port[,host:port...]/<master>[/<db>]``
(``rediss+sentinel://`` for TLS to the master), and ``?sentinel_password=...[&sentinel_username=...]``
for sentinels that ask for their own credentials (``requirepass`` in sentinel.conf). One variable
configures every process the same way.

The client is redis-py's ``Sentinel(...).master_for(master)``: each new connection asks the sentinels
where the primary is, and a connection that finds a demoted primary is dropped, so the client follows a
failover without a restart. The credentials before ``@`` are the data nodes'; the sentinels are asked
with the ``sentinel_*`` ones of the query, or none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

from redis import Redis
from redis.sentinel import Sentinel, SentinelConnectionPool

SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_FORM = (
    "redis+sentinel://[user:password@]host:port[,host:port...]/<master name>[/<db>]"
    "[?sentinel_password=...[&sentinel_username=...]]"
)
QUERY_OPTIONS = ("sentinel_username", "sentinel_password")
SENTINEL_TIMEOUT = 2.0  # seconds a sentinel may take to say where the primary is


@dataclass(frozen=True)
class SentinelTarget:
    instances: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False
    sentinel_username: str | None = None  # the sentinels' own credentials, if they ask for any
    sentinel_password: str | None = field(default=None, repr=False)

    def sentinel_auth(self) -> dict[str, str]:
        auth = {"username": self.sentinel_username, "password": self.sentinel_password}
        return {k: v for k, v in auth.items() if v}


def is_sentinel(url: str) -> bool:
    return url.partition("://")[0].lower() in SCHEMES


def parse(url: str) -> SentinelTarget:
    """Raises ValueError (whose text never holds the password) for a malformed Sentinel URL."""
    scheme, _, rest = url.partition("://")
    ssl = SCHEMES[scheme.lower()]
    rest, _, query = rest.partition("?")
    options = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(options) - set(QUERY_OPTIONS))
    if unknown:
        # Not quoted: an unknown "option" may be the end of a password holding an unencoded "&".
        raise ValueError(f"an unknown query option (known: {', '.join(QUERY_OPTIONS)}); expected {SENTINEL_FORM}")
    creds, at, location = rest.rpartition("@")
    if not at:
        creds, location = "", rest
    hosts, _, path = location.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2:
        raise ValueError(f"expected {SENTINEL_FORM}")
    if len(parts) == 2 and not parts[1].isdigit():
        raise ValueError(f"the database must be a number; expected {SENTINEL_FORM}")
    instances = tuple(_host_port(h) for h in hosts.split(",") if h)
    user, colon, password = creds.partition(":")
    if not colon:  # a lone credential is a password, as in redis://secret@host
        user, password = "", user
    return SentinelTarget(
        instances=instances,
        master=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
        ssl=ssl,
        sentinel_username=options.get("sentinel_username", [""])[-1] or None,
        sentinel_password=options.get("sentinel_password", [""])[-1] or None,
    )


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:26379
        host, _, port = text[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"a sentinel address has no host; expected {SENTINEL_FORM}")
    if port and not port.isdigit():
        raise ValueError(f"a sentinel port must be a number; expected {SENTINEL_FORM}")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


def client(target: SentinelTarget, **options: Any) -> Redis:
    """A client for the master ``target`` names; ``options`` are the data connections' (retries,
    timeouts, keepalive, pool size: ``agentpool.runtime.connections`` builds them). The sentinels are
    asked with the same keepalive and at most ``SENTINEL_TIMEOUT`` of socket timeout: a sentinel answers
    at once, and one gone silent must not hold up finding the primary."""
    sentinel_kwargs = {k: v for k, v in options.items() if k in ("socket_keepalive", "socket_keepalive_options")}
    for name in ("socket_timeout", "socket_connect_timeout"):
        sentinel_kwargs[name] = min(options.get(name) or SENTINEL_TIMEOUT, SENTINEL_TIMEOUT)
    sentinel_kwargs.update(target.sentinel_auth())
    manager = Sentinel(list(target.instances), sentinel_kwargs=sentinel_kwargs)
    return manager.master_for(
        target.master,
        db=target.db,
        username=target.username,
        password=target.password,
        ssl=target.ssl,
        **options,
    )


def clone(r: Redis, **overrides: Any) -> Redis | None:
    """A client with a pool of its own and the settings of ``r``'s, if ``r`` goes through Sentinel;
    else None (the caller builds one from the pool's class)."""
    pool = r.connection_pool
    if not isinstance(pool, SentinelConnectionPool):
        return None
    kwargs = {**pool.connection_kwargs, **overrides}
    kwargs.pop("connection_pool", None)  # the old pool's proxy: the new pool makes its own
    kwargs["connection_class"] = pool.connection_class
    return Redis(
        connection_pool=SentinelConnectionPool(
            pool.service_name, pool.sentinel_manager, max_connections=pool.max_connections, **kwargs
        )
    )


def rq_settings(url: str, socket_timeout: float | None = None) -> dict[str, Any]:
    """RQ's ``SENTINEL`` setting (``rq ... -c settings``, read by ``rq.cli.helpers.get_redis_from_config``
    in RQ 3.0) for a Sentinel URL."""
    target = parse(url)
    return {
        "INSTANCES": list(target.instances),
        "MASTER_NAME": target.master,
        "DB": target.db,
        "USERNAME": target.username,
        "PASSWORD": target.password,
        "SSL": target.ssl,
        "SOCKET_TIMEOUT": socket_timeout,
        "SENTINEL_KWARGS": {
            "socket_timeout": SENTINEL_TIMEOUT,
            "socket_connect_timeout": SENTINEL_TIMEOUT,
            **target.sentinel_auth(),
        },
    }
