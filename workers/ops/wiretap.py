"""A TCP proxy in front of Redis that records what its clients send and what Redis answers.

``agentpool bench --only capacity`` puts it between a pool and its Redis to learn exactly what a turn
sends Redis, round trip by round trip, so that the same requests can be replayed later against a Redis
core kept busy (``agentpool.ops.bench_capacity``). It parses nothing while the pool runs: each
connection's bytes are appended, with a sequence number, as they pass, from the connection's first byte
(so its handshake and the start of every reply are known); ``round_trips`` turns those answered between
``start()`` and ``stop()`` into commands and replies afterwards. A round trip is what a client sent before Redis began to answer it (a
pipeline's commands arrive together); the sequence numbers put every connection's round trips in one
order, the order in which Redis answered them (the order it served them in: a blocking dequeue waits).
"""

from __future__ import annotations

import itertools
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import hiredis

Command = tuple[bytes, ...]

SUBSCRIBING = {b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE"}  # a pub/sub connection is pushed to, not answered


@dataclass
class RoundTrip:
    seq: int  # when Redis answered it, among every connection's round trips
    connection: int
    commands: list[Command]
    replies: list[object] = field(default_factory=list)  # what Redis answered, one reply a command
    protocol: int = 2  # RESP version of its connection (HELLO 3 makes it 3)


def shape(reply: object) -> str:
    """What kind of answer a reply is, enough to tell a script that took another branch: an error (its
    code), nil, a number, a string, or an array and its length."""
    if isinstance(reply, hiredis.ReplyError):
        return "error " + str(reply).split(" ", 1)[0]
    # The same answer in RESP2 and RESP3 has one shape: a map is an array of its keys and values, a set an
    # array, a double a string, a boolean a number.
    if isinstance(reply, dict):
        return f"array of {2 * len(reply)}"
    if isinstance(reply, (list, set)):
        return f"array of {len(reply)}"
    if isinstance(reply, (float, bytes, str)):
        return "string"
    if isinstance(reply, (bool, int)):
        return "number"
    return "nil" if reply is None else type(reply).__name__


@dataclass
class _Connection:
    number: int
    # (sequence number, True for the client's bytes / False for Redis's) as they passed
    chunks: list[tuple[int, bool, bytes]] = field(default_factory=list)


class Wiretap:
    """Listens on 127.0.0.1 (``url_for``: a Redis URL with the proxy's address) and forwards to
    ``host:port``. Round trips sent between ``start()`` and ``stop()`` are the recording."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._seq = itertools.count()
        self.window = (0, -1)  # the sequence numbers of the recording: none yet
        self._connections: list[_Connection] = []
        self._closing = False
        threading.Thread(target=self._accept, name="wiretap-accept", daemon=True).start()

    def url_for(self, url: str) -> str:
        """``url``, a redis:// URL of the server this proxies, with the proxy's address in its place (its
        credentials and database kept)."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        return urlunsplit(parts._replace(netloc=f"{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"))

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(len(self._connections))
            self._connections.append(connection)
            threading.Thread(target=self._pump, args=(client, server, connection, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, connection, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, connection: _Connection, from_client: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                # Numbered before it is forwarded: a reply is always numbered after its request.
                connection.chunks.append((next(self._seq), from_client, data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def start(self) -> None:
        self.window = (next(self._seq), 1 << 62)

    def stop(self) -> None:
        self.window = (self.window[0], next(self._seq))

    def close(self) -> None:
        self._closing = True
        self.listener.close()

    def round_trips(self) -> list[RoundTrip]:
        """The recording's requests, parsed into commands and grouped into round trips, in Redis's order,
        each with its replies. A pub/sub connection's are left out (it is pushed messages; nothing it sends
        is a turn's work)."""
        first, last = self.window
        trips: list[RoundTrip] = []
        for connection in self._connections:
            requests, answers = hiredis.Reader(), hiredis.Reader()
            mine: list[RoundTrip] = []
            current: RoundTrip | None = None
            protocol = 2
            for seq, from_client, data in sorted(connection.chunks):
                if not from_client:
                    if current is not None:
                        # Redis's order is the order it answered in: a blocking dequeue sent before the job
                        # was pushed is served after the push.
                        current.seq = seq
                    current = None  # Redis answered: what the client sends next is another round trip
                    answers.feed(data)
                    continue
                requests.feed(data)
                while (command := requests.gets()) is not False:
                    if current is None:
                        current = RoundTrip(-1, connection.number, [], protocol=protocol)  # not answered yet
                        mine.append(current)
                    current.commands.append(tuple(command))
                    if command[0].upper() == b"HELLO" and len(command) > 1:
                        protocol = int(command[1])
            if any(c[0].upper() in SUBSCRIBING for trip in mine for c in trip.commands):
                continue
            for trip in mine:  # hiredis reads RESP2 and RESP3 alike
                trip.replies = [_next(answers) for _ in trip.commands]
            trips += [trip for trip in mine if first <= trip.seq <= last]
        return sorted(trips, key=lambda trip: trip.seq)


def _next(reader: hiredis.Reader) -> object:
    reply = reader.gets()
    return "(no reply recorded)" if reply is False else reply
