"""How the operator tools reach Redis: quickly, and with one line when they cannot.

A worker rides out a Redis restart (``agentpool.runtime.settings.connect`` retries for ~15 s); a person
typing ``agentpool runs`` wants an answer now. So the interactive commands use :func:`quick_client`
(2 s to connect, one quick retry), and :class:`OneLineErrors` turns whatever Redis error escapes a
command into ``error: Redis unreachable at redis://host:port/0 (from REDIS_URL): Connection refused``
instead of a traceback. URLs are always shown without their password.

On a sharded pool (``AGENTPOOL_SHARDS``), :func:`pool_client` gives the commands that read the whole pool
a :class:`~agentpool.runtime.shards.Shards` of such clients (``--url`` on the command line still names
one Redis: a shard of its own), and an error names the shard that failed.
"""

from __future__ import annotations

import re
import sys
from typing import Any
from urllib.parse import urlsplit

import click
from click.core import ParameterSource
from redis import Redis
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, ResponseError, TimeoutError
from redis.sentinel import MasterNotFoundError

from agentpool.runtime import connections, shards
from agentpool.runtime.settings import BadRedisUrl, Settings, check_redis_url, redact_url
from agentpool.store.errors import RedisUnreachable

# The URL the current command talks to, and where it came from, for the error line.
_target: dict[str, str] = {}


def target_url(url: str | None, *, param: str = "url") -> str:
    """The URL a command was given (``--url``, else ``REDIS_URL``, else the default), checked: a
    malformed one is a :class:`BadRedisUrl` naming where it came from and the expected form."""
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source(param) if ctx is not None and param in ctx.params else None
    flag = "--" + param.replace("_", "-")
    if url is None:
        subject, origin = "the default URL", "the default; set REDIS_URL or pass --url"
    elif source is ParameterSource.ENVIRONMENT:
        subject, origin = "REDIS_URL", "from REDIS_URL"
    else:
        subject, origin = flag, f"from {flag}"
    url = url or Settings.from_env().redis_url
    _target.update(url=redact_url(url), origin=origin)
    return check_redis_url(url, subject=subject)


def quick_client(
    url: str | None, *, socket_timeout: float = 10.0, retries: int = 1, param: str = "url", **options: Any
) -> Redis:
    """A client for a command a person waits on: 2 s to connect, one quick retry (also after a
    connection that went silent for ``socket_timeout``), no 15 s ride-out."""
    return _quick(target_url(url, param=param), socket_timeout=socket_timeout, retries=retries, **options)


def _quick(url: str, *, socket_timeout: float = 10.0, retries: int = 1, **options: Any) -> Redis:
    return connections.build(
        url, retry=connections.quick(retries), socket_timeout=socket_timeout, socket_connect_timeout=2, **options
    )


def shard_urls(url: str | None, *, param: str = "url") -> tuple[str, ...]:
    """The shards a command serves or reads: ``AGENTPOOL_SHARDS``'s, unless ``--url`` was given on the
    command line (then none: that one Redis); empty when it is not set. A bad list is a BadShards."""
    ctx = click.get_current_context(silent=True)
    given = ctx is not None and param in ctx.params and ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE
    if given and url:
        return ()
    return shards.env_urls()


def pool_client(
    url: str | None, *, socket_timeout: float = 10.0, retries: int = 1, param: str = "url", **options: Any
) -> Redis | shards.Shards:
    """For a command that reads the whole pool: ``quick_client``'s Redis, or on a sharded pool a
    ``Shards`` of such clients, one per shard (``shard_urls``)."""
    urls = shard_urls(url, param=param)
    if not urls:
        return quick_client(url, socket_timeout=socket_timeout, retries=retries, param=param, **options)
    _target.update(url=", ".join(redact_url(u) for u in urls), origin=f"from {shards.ENV}", shards=" ".join(urls))
    built = [_quick(u, socket_timeout=socket_timeout, retries=retries, **options) for u in urls]
    return shards.Shards(built, origin=shards.ENV)


def shard_target(shard: int, url: str) -> str:
    """Record that the command talks to shard ``shard`` (``url``), for the error line."""
    _target.update(url=redact_url(url), origin=f"shard {shard} of {shards.ENV}")
    _target.pop("shards", None)
    return url


def reason(exc: RedisError) -> str:
    """redis-py's message without the noise: "Error 111 connecting to h:p. Connection refused." ->
    "Connection refused"."""
    text = str(exc).strip() or type(exc).__name__
    found = re.match(r"Error -?\d+ connecting to \S+?\.? (.*)$", text, re.DOTALL)
    return (found.group(1) if found else text).rstrip(".")


def describe(exc: RedisError) -> str:
    blamed = getattr(exc, "shard", None)  # the API knew which shard (RedisUnreachable.shard)
    if isinstance(exc, RedisUnreachable) and isinstance(exc.__cause__, RedisError):
        exc = exc.__cause__  # the API's own wording names the server; the command's names where the URL came from
    where = f"{_target.get('url', '?')} ({_target.get('origin', 'from REDIS_URL')})"
    urls = _target.get("shards", "").split()
    failed = (blamed, urls[blamed]) if isinstance(blamed, int) and 0 <= blamed < len(urls) else _failed_shard(str(exc))
    if failed is not None:
        where = f"shard {failed[0]}, {redact_url(failed[1])} (from {shards.ENV})"
    if isinstance(exc, MasterNotFoundError):
        return f"Redis unreachable at {where}: {_no_primary(exc)}"
    if isinstance(exc, AuthenticationError) or _refused_credentials(str(exc)):
        return f"Redis at {where} refused the credentials: {reason(exc)}"
    if isinstance(exc, ResponseError):
        return f"Redis at {where} answered with an error: {reason(exc)}"
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return f"Redis unreachable at {where}: {reason(exc)}"
    return f"Redis at {where}: {reason(exc)}"


def _failed_shard(text: str) -> tuple[int, str] | None:
    """On a sharded pool, the shard whose address redis-py's message names ("connecting to host:port")."""
    for n, url in enumerate(_target.get("shards", "").split()):
        try:
            parts = urlsplit(url)
            address = f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else ""
        except ValueError:
            continue
        if address and re.search(rf" {re.escape(address)}(?!\d)", text):
            return n, url
    return None


def _no_primary(exc: MasterNotFoundError) -> str:
    """redis-py's message holds each sentinel client's whole repr; keep the master's name and the
    errors, and say what to do about the common ones."""
    text = str(exc)
    name = re.match(r"No master found for ('[^']*'|\S+)", text)
    errors = re.findall(r" - (.+?)(?=, <redis\.client|$)", text, re.DOTALL)
    master = name.group(1) if name else "the master"
    if not errors:
        return f"no sentinel knows a primary named {master} (check the master name in the URL)"
    said = "; ".join(dict.fromkeys(e.strip() for e in errors))
    if _refused_credentials(said):
        return (
            f"the sentinels refused the credentials while asked for {master} ({said}); "
            "give theirs with ?sentinel_password=...[&sentinel_username=...] in the URL"
        )
    return f"no sentinel answered where {master} is ({said})"


def _refused_credentials(text: str) -> bool:
    """Redis's (and redis-py's) words for a password or user refused."""
    return any(word in text for word in ("WRONGPASS", "NOAUTH", "AuthenticationError"))


def warn_if_unreachable(r: Redis | shards.Shards, what: str) -> None:
    """For a server that keeps serving while Redis is away (metrics, dashboard): one line (a shard), not a stop."""
    for _shard, client in shards.each(r):
        try:
            client.ping()
        except RedisError as exc:
            click.echo(f"warning: {describe(exc)}; {what}", err=True)


class OneLineErrors(click.Group):
    """The ``agentpool`` group: a malformed Redis URL (exit 2) or a Redis error (exit 1) that escapes a
    command is one line on stderr, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BadRedisUrl as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except RedisError as exc:
            click.echo(f"error: {describe(exc)}", err=True)
            sys.exit(1)
