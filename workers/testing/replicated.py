"""Replicated Redis on free ports, for failover tests and the durability bench, with the same
``redis-server`` binary (``--replicaof``, ``--sentinel``), nothing else to install:

- ``ReplicatedRedis``: a primary, one or two replicas and a sentinel; clients use ``redis+sentinel://``.
- ``FollowingEndpoint``: a primary, a replica that a test promotes itself, and that replica's own
  replica; clients use a plain ``redis://`` endpoint (a proxy) that follows the promotion, as a managed
  primary endpoint or a virtual IP does.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO
from urllib.parse import quote

from redis import Redis
from redis.exceptions import RedisError

from agentpool.testing.localpool import RedisServer, free_port
from agentpool.testing.netfault import NetFault

MASTER = "agentpool"


class ReplicatedRedis:
    """``url`` is a ``redis+sentinel://`` URL; ``servers`` maps a port to its ``RedisServer``."""

    def __init__(
        self,
        workdir: Path,
        *,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        sentinel_password: str | None = None,
        replicas: int = 1,
    ) -> None:
        self.workdir = workdir
        self.primary = RedisServer(self._dir("primary"))
        # Each replica reaches the primary through a proxy, so a test can cut replication alone.
        self.replica_links = [NetFault(("127.0.0.1", self.primary.port)).start() for _ in range(replicas)]
        self.replica_link = self.replica_links[0]
        self.replicas = [
            RedisServer(self._dir(f"replica{n or ''}"), extra_args=("--replicaof", "127.0.0.1", str(link.port)))
            for n, link in enumerate(self.replica_links)
        ]
        self.replica = self.replicas[0]
        self.servers = {s.port: s for s in (self.primary, *self.replicas)}
        self.sentinel_port = free_port()
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.sentinel: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.sentinel_password = sentinel_password  # the sentinel's own requirepass, if given
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{MASTER}/0"
        if sentinel_password:
            self.url += f"?sentinel_password={quote(sentinel_password, safe='')}"

    def _dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self) -> ReplicatedRedis:
        _start_or_stop(self._start, self.stop)
        return self

    def _start(self) -> None:
        self.primary.start()
        for replica in self.replicas:
            replica.start()
        self.wait_replicas(len(self.replicas))
        conf = self._dir("sentinel") / "sentinel.conf"  # sentinel rewrites it: its own, writable
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {conf.parent}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
            f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
            + (f"requirepass {self.sentinel_password}\n" if self.sentinel_password else "")
        )
        self._log = open(conf.parent / "sentinel.log", "wb")  # noqa: SIM115 - closed by stop()
        self.sentinel = subprocess.Popen(
            [self.primary.binary, str(conf), "--sentinel"], stdout=self._log, stderr=subprocess.STDOUT
        )
        self.wait_primary(self.primary.port)

    def sentinel_client(self) -> Redis:
        return Redis(port=self.sentinel_port, socket_timeout=2, password=self.sentinel_password)

    def primary_port(self) -> int | None:
        """Where the sentinel says the primary is now."""
        try:
            with self.sentinel_client() as sentinel:  # closed here: it is asked many times a second
                found = sentinel.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
        except RedisError:
            return None
        return int(found[1]) if found else None

    def wait_primary(self, port: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.primary_port() != port:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel never named port {port} primary (it says {self.primary_port()})")
            time.sleep(0.05)

    def wait_replicas(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with Redis(port=self.primary.port) as client:
            while client.info("replication").get("connected_slaves", 0) < n or not all(
                _synced(replica.port) for replica in self.replicas
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica never synced:\n" + logs_of(self.replicas))
                time.sleep(0.05)

    def cut_replication(self) -> None:
        """Cut every replica off the primary (their links partitioned: silence, as across a cut network).
        A sentinel "fixes" a replica that replicates from an address other than the primary's: about 10 s
        after start (its first INFO period) each replica follows the primary directly, not through its
        link. That fix is waited for first, or it could land just after the cut and undo it (a test whose
        workers took long to start, on a loaded machine, cut replication at that very moment), and so is
        the sentinel's next look at the replicas, which sees them follow the primary. Then each replica is
        pointed back at its link. The sentinel notices that change at its next look (within 10 s) and
        leaves it for its failover timeout (3 s) before fixing it again. Without that look in between,
        the sentinel still held the link's address it saw before the fix, took the cut for the old
        misconfiguration and fixed it at once: within a second, before any tool had met the cut (two
        cut tests run side by side failed so every time)."""
        self.wait_for_sentinel_fix()
        for link, replica in zip(self.replica_links, self.replicas):
            link.partition()
            client = Redis(port=replica.port)
            try:
                client.execute_command("REPLICAOF", "127.0.0.1", str(link.port))
            finally:
                client.close()

    def wait_for_sentinel_fix(self) -> None:
        """Until the sentinel has pointed every replica at the primary directly, and has seen since that
        they follow it (see ``cut_replication``): about 20 s after start. A test whose work must still be
        going on when it cuts replication waits for this before it starts that work."""
        primary = self.primary_port()
        deadline = time.monotonic() + 45
        for replica in self.replicas:
            client = Redis(port=replica.port)
            try:
                while int(client.info("replication").get("master_port", 0)) != primary:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the sentinel never pointed the replica on {replica.port} at {primary}")
                    time.sleep(0.05)
            finally:
                client.close()
        while self._seen_following() != {replica.port: primary for replica in self.replicas}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel never saw the replicas follow {primary}: {self._seen_following()}")
            time.sleep(0.1)

    def _seen_following(self) -> dict[int, int]:
        """Replica port -> the port of the primary it followed at the sentinel's last look at it."""
        with self.sentinel_client() as sentinel:  # redis-py parses each into a dict, ports as int
            return {replica["port"]: replica.get("master-port", 0) for replica in sentinel.sentinel_slaves(MASTER)}

    def kill_primary(self, *, restart: bool = True) -> int:
        """SIGKILL whichever server is primary now and wait until the sentinel promotes the other one;
        then (``restart``) start the killed one again, empty, as a replica of the new primary, as an
        orchestrator would, so a guard that waits for one replica can be met again.
        Returns the new primary's port."""
        old = self.primary_port()
        assert old is not None
        self.servers[old].stop(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (new := self.primary_port()) in (old, None):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel never promoted a replica of port {old}")
            time.sleep(0.05)
        if restart:
            self.restart_as_replica(old)
        return new

    def restart_as_replica(self, port: int) -> None:
        """Start the (killed) server on ``port`` again, empty, as a replica of the primary now.

        Started as a replica of the new primary outright, as an orchestrator restarting it with the
        sentinel's view would: waiting for the sentinel to convert it took over 60 s under load. It may
        not be promoted before its first sync is done (replica-priority 0 until then): a loaded machine
        can make the sentinel think the new primary down, and a second failover to an empty replica
        would lose every run, which no real orchestrator allows either."""
        primary = self.primary_port()
        assert primary is not None and primary != port
        self.servers[port].extra_args = ("--replicaof", "127.0.0.1", str(primary), "--replica-priority", "0")
        self.servers[port].start()
        deadline = time.monotonic() + 60
        with Redis(port=port) as replica:
            while replica.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"port {port} never synced as a replica of {primary}:\n{logs_of([self.servers[port]])}"
                    )
                time.sleep(0.05)
            replica.config_set("replica-priority", 100)

    def stop(self) -> None:
        if self.sentinel and self.sentinel.poll() is None:
            self.sentinel.kill()
            self.sentinel.wait(timeout=10)
        for server in self.servers.values():
            server.stop(signal.SIGKILL)
        for link in self.replica_links:
            link.stop()
        if self._log:
            self._log.close()


def _start_or_stop(start: Callable[[], None], stop: Callable[[], None]) -> None:
    """``start()``, or ``stop()`` what it started if it fails: a server left running would outlive the test
    that failed to start it (and its collected process handle fail another test with a ResourceWarning)."""
    try:
        start()
    except BaseException:
        stop()
        raise


def logs_of(servers: list[RedisServer]) -> str:
    return "\n".join(f"--- port {server.port}:\n{server.log_tail()}" for server in servers)


def _synced(port: int) -> bool:
    try:
        with Redis(port=port) as client:  # closed here: a socket left to the collector is a ResourceWarning
            return client.info("replication").get("master_link_status") == "up"
    except RedisError:
        return False


class FollowingEndpoint:
    """A primary; a replica of it (``replica``, through ``replica_link``, a proxy a test can partition);
    a replica of that replica (``sub_replica``). Clients use ``url``: a proxy to the primary that
    ``promote()`` re-points at ``replica`` once it is promoted, as a managed primary endpoint or a
    virtual IP follows a failover. No sentinel: the test decides when the failover happens."""

    def __init__(self, workdir: Path) -> None:
        def where(name: str) -> Path:
            path = workdir / name
            path.mkdir(parents=True, exist_ok=True)
            return path

        self.primary = RedisServer(where("primary"))
        self.replica_link = NetFault(("127.0.0.1", self.primary.port))
        self.replica = RedisServer(where("replica"), extra_args=("--replicaof", "127.0.0.1", "0"))
        self.sub_replica = RedisServer(
            where("sub_replica"), extra_args=("--replicaof", "127.0.0.1", str(self.replica.port))
        )
        self.endpoint = NetFault(("127.0.0.1", self.primary.port))

    @property
    def url(self) -> str:
        return self.endpoint.url

    def start(self) -> FollowingEndpoint:
        _start_or_stop(self._start, self.stop)
        return self

    def _start(self) -> None:
        self.primary.start()
        self.replica_link.start()
        self.replica.extra_args = ("--replicaof", "127.0.0.1", str(self.replica_link.port))
        self.replica.start()
        self.sub_replica.start()
        self.endpoint.start()
        deadline = time.monotonic() + 60
        while not (_synced(self.replica.port) and _synced(self.sub_replica.port)):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas never synced:\n" + logs_of([self.replica, self.sub_replica]))
            time.sleep(0.05)

    def promote(self) -> None:
        """SIGKILL the primary, promote ``replica`` (its own replica stays attached) and re-point the
        endpoint at it: open connections are closed, new ones reach the new primary."""
        self.primary.stop(signal.SIGKILL)
        client = Redis(port=self.replica.port)
        try:
            client.execute_command("REPLICAOF", "NO", "ONE")
        finally:
            client.close()
        self.endpoint.retarget(("127.0.0.1", self.replica.port))

    def stop(self) -> None:
        self.endpoint.stop()
        for server in (self.sub_replica, self.replica, self.primary):
            server.stop(signal.SIGKILL)
        self.replica_link.stop()
