"""A TCP proxy in front of Redis that loses replies and partitions the network, on purpose.

Clients connect to the proxy (``NetFault.url``) instead of Redis. Everything is forwarded as is,
except that the proxy can:

- **lose a reply**: after Redis has received a request and answered it, close the client's connection
  without passing the answer on. Redis applied the write; the client saw a dropped connection, and a
  client that retries (redis-py with ``retry_on_error=[ConnectionError, ...]``) sends it again. On
  demand (``cut_next_reply(pattern)``: the reply to the next request containing ``pattern``) or at a
  rate (``reply_loss=0.01``: one reply in a hundred, chosen at random);
- **black-hole a connection**: after Redis has answered a request, swallow the answer and go silent on
  that connection for good (nothing more forwarded either way, nothing closed: no FIN, no RST), as a
  dropped NAT or conntrack entry, a load balancer failover or a live-migrated VM does. Only a client
  that gives up on a silent socket (a socket timeout) gets past it. On demand
  (``black_hole_next(pattern)``) or at a rate (``black_hole=0.01``);
- **partition**: ``partition()`` stops forwarding in both directions and holds new connections until
  ``heal()``; nothing is closed, so clients see silence, as across a cut network link;
- **hold one request**: ``hold_next(pattern)`` keeps the next request containing ``pattern`` from
  Redis until ``release()``, so a test can put another client's writes before it: races played in
  a chosen order instead of hoped for;
- **follow a failover**: ``retarget((host, port))`` points new connections at another server and
  closes the open ones, as a managed primary endpoint, a virtual IP or a proxy in front of Sentinel
  does when a replica is promoted: a client's re-sent request reaches the new primary.

Used by the tests to prove every write is safe to deliver twice; usable by apps for the same purpose::

    with NetFault.to(redis_url, reply_loss=0.01) as proxy:  # or black_hole=0.01
        r = connect(proxy.url)
        ...
"""

from __future__ import annotations

import random
import select
import socket
import threading
import time
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit, urlunsplit

CHUNK = 65536
DRAIN_S = 0.05  # after a reply to be lost starts to arrive, wait this long for the rest of it


def resp_command(*words: str | bytes) -> bytes:
    """The first words of a request as redis-py puts them on the wire (RESP bulk strings), without
    the array's length: a pattern for ``cut_next_reply`` that matches that command whatever its other
    arguments, e.g. ``resp_command("EXEC")`` or ``resp_command("EVALSHA", sha)``."""
    parts = [w.encode() if isinstance(w, str) else w for w in words]
    return b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: NetFault, client: socket.socket) -> None:
        self.proxy, self.client = proxy, client
        self.upstream: socket.socket | None = None
        self.cut_pending = False
        self.hole_pending = False  # the next reply is swallowed and the link goes silent
        self.silent = False
        self.closed = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="netfault-link", daemon=True).start()

    def _run(self) -> None:
        try:
            self.proxy._healed.wait()
            self.upstream = socket.create_connection(self.proxy.upstream)
            self.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            # The client closed under us (a setsockopt on it fails): close() may have run before the
            # upstream connection existed, and found none to close.
            self.close()
            if self.upstream is not None:
                self.upstream.close()
            return
        if self.closed.is_set():
            # Closed (a retarget, a drop, the proxy's stop) while connecting: close() found no upstream
            # to close yet. Closing it here as well is harmless if close() did after all.
            self.upstream.close()
            return
        threading.Thread(target=self._requests, name="netfault-up", daemon=True).start()
        self._replies()

    def _requests(self) -> None:
        assert self.upstream is not None
        while not self.closed.is_set():
            data = self._recv(self.client)
            if not data:
                break
            self.proxy._healed.wait()
            self.proxy._maybe_hold(data)
            if self.silent:
                continue  # swallowed: a black hole forwards nothing, and closes nothing
            if self.proxy._take_cut(data):
                self.cut_pending = True
            if self.proxy._take_hole(data):
                self.hole_pending = True
            try:
                self.upstream.sendall(data)
            except OSError:
                break
        self.close()

    def _replies(self) -> None:
        assert self.upstream is not None
        while not self.closed.is_set():
            data = self._recv(self.upstream)
            if not data:
                break
            self.proxy._healed.wait()
            if self.silent:
                continue
            if self.hole_pending or self.proxy._hole_at_random():
                self.silent = True  # Redis applied the request; its answer, and all after it, vanish
                self.proxy._count_hole()
                continue
            if self.cut_pending or self.proxy._lose_at_random():
                self._drain(self.upstream)  # the whole answer reached us: Redis is done with the request
                self.proxy._count_cut()
                break
            try:
                self.client.sendall(data)
            except OSError:
                break
        self.close()

    def _recv(self, sock: socket.socket) -> bytes:
        try:
            return sock.recv(CHUNK)
        except OSError:
            return b""

    @staticmethod
    def _drain(sock: socket.socket) -> None:
        deadline = time.monotonic() + DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([sock], [], [], left)
            if ready and not sock.recv(CHUNK):
                return

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.proxy._forget(self)


class NetFault:
    """A fault-injecting TCP proxy to ``upstream`` (host, port). See the module docstring."""

    def __init__(
        self, upstream: tuple[str, int], *, reply_loss: float = 0.0, black_hole: float = 0.0, seed: int | None = None
    ) -> None:
        self.upstream = upstream
        self.reply_loss = reply_loss
        self.black_hole = black_hole
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._cuts: list[list[bytes | int]] = []  # [pattern, times left]
        self._holes: list[list[bytes | int]] = []
        self._links: set[_Link] = set()
        self._healed = threading.Event()
        self._healed.set()
        self._hold: bytes | None = None
        self._holding = threading.Event()  # a request is held
        self._released = threading.Event()
        self._listener: socket.socket | None = None
        self.replies_cut = 0
        self.black_holed = 0  # connections gone silent
        self.upstream_url = f"redis://{upstream[0]}:{upstream[1]}/0"

    @classmethod
    def to(cls, redis_url: str, **options: float | None) -> NetFault:
        """A proxy for the Redis at ``redis_url`` (not started); ``url`` is then the same URL through it."""
        parts = urlsplit(redis_url)
        proxy = cls((parts.hostname or "127.0.0.1", parts.port or 6379), **options)  # type: ignore[arg-type]
        proxy.upstream_url = redis_url
        return proxy

    # -- lifecycle --

    def start(self) -> Self:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, name="netfault-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        self.heal()
        self.release()
        with self._lock:  # a connection accepted from now on is closed, not linked (_accept)
            listener, self._listener = self._listener, None
            links = list(self._links)
        if listener is not None:
            listener.close()
        for link in links:
            link.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._listener is not None, "the proxy is not started"
        return int(self._listener.getsockname()[1])

    @property
    def url(self) -> str:
        """``upstream_url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(self.upstream_url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    # -- faults --

    def cut_next_reply(self, pattern: bytes = b"", times: int = 1) -> None:
        """Lose the reply to the next ``times`` requests whose bytes contain ``pattern`` (any request
        if empty): Redis gets and applies each of them, the client's connection is closed before the
        answer reaches it."""
        with self._lock:
            self._cuts.append([pattern, times])

    def black_hole_next(self, pattern: bytes = b"", times: int = 1) -> None:
        """Swallow the reply to the next ``times`` requests whose bytes contain ``pattern`` (any request
        if empty) and leave each of their connections open and silent for good: Redis gets and applies
        the request; the client hears nothing more on that connection, not even a close."""
        with self._lock:
            self._holes.append([pattern, times])

    def pending_cuts(self) -> int:
        """Cuts armed with ``cut_next_reply`` that no request has triggered yet."""
        with self._lock:
            return sum(int(times) for _pattern, times in self._cuts + self._holes)

    def hold_next(self, pattern: bytes) -> None:
        """Keep the next request containing ``pattern`` from Redis until ``release()``."""
        with self._lock:
            self._hold = pattern
            self._holding.clear()
            self._released.clear()

    def wait_held(self, timeout: float = 10.0) -> bool:
        """Until a request is being held (True), or ``timeout`` seconds (False)."""
        return self._holding.wait(timeout)

    def release(self) -> None:
        """Let the held request (and any later one) through."""
        with self._lock:
            self._hold = None
        self._released.set()

    def partition(self) -> None:
        """Stop forwarding, both ways, and hold new connections, until ``heal()``."""
        self._healed.clear()

    def heal(self) -> None:
        self._healed.set()

    def retarget(self, upstream: tuple[str, int]) -> None:
        """From now on connect to ``upstream``; every open connection is closed (a held request is never
        delivered to the old server)."""
        with self._lock:
            self.upstream = upstream
        self.drop_connections()

    def drop_connections(self) -> None:
        """Close every connection now (as a Redis restart or a reset by a middlebox would)."""
        for link in list(self._links):
            link.close()

    # -- used by the links --

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                client, _addr = listener.accept()
            except OSError:
                return
            link = _Link(self, client)
            with self._lock:
                stopped = self._listener is None  # stop() ran while this connection was accepted
                if not stopped:
                    self._links.add(link)
            if stopped:
                client.close()
                return
            link.start()

    def _maybe_hold(self, data: bytes) -> None:
        with self._lock:
            hold = self._hold is not None and self._hold in data
            if hold:
                self._hold = None
        if hold:
            self._holding.set()
            self._released.wait()

    def _take_cut(self, data: bytes) -> bool:
        return self._take(self._cuts, data)

    def _take_hole(self, data: bytes) -> bool:
        return self._take(self._holes, data)

    def _take(self, armed: list[list[bytes | int]], data: bytes) -> bool:
        with self._lock:
            for cut in armed:
                pattern = cut[0]
                assert isinstance(pattern, bytes)
                if pattern in data:
                    cut[1] = int(cut[1]) - 1
                    if cut[1] <= 0:
                        armed.remove(cut)
                    return True
        return False

    def _lose_at_random(self) -> bool:
        return self._at_random(self.reply_loss)

    def _hole_at_random(self) -> bool:
        return self._at_random(self.black_hole)

    def _at_random(self, rate: float) -> bool:
        if rate <= 0:
            return False
        with self._lock:
            return self._random.random() < rate

    def _count_cut(self) -> None:
        with self._lock:
            self.replies_cut += 1

    def _count_hole(self) -> None:
        with self._lock:
            self.black_holed += 1

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
