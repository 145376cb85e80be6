"""Settings read once from the environment. The store takes explicit arguments, never these."""

from __future__ import annotations

import os
from dataclasses import dataclass

from redis import BlockingConnectionPool, Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from agentpool.store import crypto

DEFAULT_REDIS_URL = "redis://localhost:6379/0"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from None


@dataclass(frozen=True)
class Settings:
    redis_url: str
    lease_ttl: float  # seconds a turn's lease lives without a heartbeat
    turn_timeout: float  # RQ's hard limit for one turn job
    reaper_interval: float
    model_retries: int  # consecutive transient model errors before a run is stopped
    retention: int  # seconds a finished run is kept; 0 keeps it forever
    agent_load_grace: float = 300.0  # seconds no worker could load a run's agent before the run stops

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            redis_url=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
            lease_ttl=_env_float("AGENTPOOL_LEASE_TTL", 15.0),
            turn_timeout=_env_float("AGENTPOOL_TURN_TIMEOUT", 3600.0),
            reaper_interval=_env_float("AGENTPOOL_REAPER_INTERVAL", 1.0),
            model_retries=int(_env_float("AGENTPOOL_MODEL_RETRIES", 6)),
            retention=int(_env_float("AGENTPOOL_RETENTION_SECONDS", 7 * 24 * 3600)),
            agent_load_grace=_env_float("AGENTPOOL_AGENT_LOAD_GRACE", 300.0),
        )

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.lease_ttl * 1000)


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


def connect(url: str | None = None, *, max_connections: int | None = None) -> Redis:
    """A client that rides out a dropped connection or a Redis restart (~15 s of retries) instead of
    failing the turn. Bytes in, bytes out: RQ requires ``decode_responses=False``.

    ``max_connections`` is for a process of many threads (``worker --concurrency N``): its threads
    share that many connections and wait up to 30 s for a free one. redis-py's default pool holds 100
    and fails the 101st caller at once (``MaxConnectionsError``)."""
    options = {
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=12),
        "retry_on_error": [ConnectionError, TimeoutError],
        "health_check_interval": 30,
        "socket_keepalive": True,
    }
    url = url or Settings.from_env().redis_url
    if max_connections is None:
        return Redis.from_url(url, **options)
    return Redis(
        connection_pool=BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30, **options)
    )


def redact_url(url: str) -> str:
    """The URL without its password, for logs and banners."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***@' if user else '***@'}{host}"
