"""``agentpool bench --only capacity``: how many turns a second one Redis core carries when it is busy.

``--only redis`` measures Redis's CPU per turn at the rate this machine's workers make turns, a few
hundred a second, where Redis sleeps between requests and pays for waking up at each one; 1,000,000
divided by that figure underestimates what a core carries once it has no time to sleep. The machine has
two CPUs, and the workers need both long before a Redis saturates, so a pool cannot be made to load one
here. Instead this section records what a pool really sends Redis and replays it at full speed:

1. **Record.** A worker serves its turns through a proxy (``agentpool.ops.wiretap``) that keeps every
   request and every reply, in the order Redis answered them, while an app enqueues the runs through it.
2. **Replay.** The recording becomes one stream of round trips. Many copies of it run at once against
   the same Redis on a CPU of its own (emptied first), each a connection for each of the recording's,
   sending a round trip when the last one was answered, as a worker's thread does. Each copy is the
   recorded pool again in keys of its own (``ap:`` and ``rq:`` renamed), so its runs are new runs and
   its state goes through the recorded changes in the recorded order: the scripts check the same leases
   and make the same writes. What the replay has to change to get there:

   - A value a script made and the pool sent back later (the lease's token carries the fence, Redis's
     clock when the lease was taken) is taken from the copy's own reply and put in its later requests
     in place of the recorded one (the one made for the same run, when two runs got the same token).
   - A blocking dequeue is replayed as the move of the very job it got (``LREM`` from the queue,
     ``RPUSH`` to RQ's intermediate list: one command more than the pool's, taken out of the count), after
     the push that fed it: Redis answers a dequeue that waited in the instant it runs that push, and
     requests that arrive together run in an order no proxy can see. One that timed out is replayed as
     a read of the queue's head.
   - A connection's handshake is left out, and so is a script call Redis did not know yet (the client's
     load and second call are replayed).
3. **Check.** Each reply is compared with the recorded one in kind (an error and its code, nil, a
   number, a string, an array and its length): a script that took another branch than it did for the
   pool would show there. The table says how many differed.

Redis's CPU (``INFO cpu``) and commands (``INFO commandstats``) around the replay give its CPU per turn
at capacity and the turns a second that makes; how busy the replay kept Redis (its CPU over the wall
time) says whether that is the core's limit (near 100 %) or the replaying process's. The same is done
for a bare RQ job (a no-op) on the same worker, the baseline, in each round, and for turns whose model call
lasts ``LONG_CALL`` seconds, recorded in scaled time (the call and the lease TTL ``TIME_SCALE`` times as
long) so that they hold their leases through as many renewals as such a call does.
"""

from __future__ import annotations

import bisect
import re
import selectors
import socket
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import click
import hiredis
from redis import Redis

from agentpool.ops.bench import TURNS_PER_RUN, Lab, cpu_and_calls, spread, table, tool_steps, until
from agentpool.ops.bench_redis import Load, _Placement, bare_load, runs_load
from agentpool.ops.wiretap import RoundTrip, Wiretap, shape
from agentpool.runtime.settings import Settings
from agentpool.store.scripts import run_script

# Every key is agentpool's (``ap:``) or RQ's (``rq:``): a copy renames the two prefixes, so it is a pool of
# its own, in keys of its own (its queue, its runs, its jobs, its workers' records), with the same ids.
PREFIXES = re.compile(rb"(?<![0-9A-Za-z_])(?:ap|rq):")
RUN_KEY = re.compile(rb"\{run:([^}]+)\}")  # a run's hash tag, in every key of the run
# A copy's two prefixes: two characters, as long as the ones they replace (no "a", "p", "q" or "r" first, so
# never "ap" or "rq" themselves).
CODES = [a + b for a in "bcdefghijklmnostuvwxyz" for b in "0123456789abcdefghijklmnopqrstuvwxyz"]
HANDSHAKE = {b"HELLO", b"CLIENT", b"AUTH", b"SELECT"}  # a connection's own setup: the replay's are made once
DEQUEUES = {b"BLMOVE", b"BRPOPLPUSH"}  # how RQ takes a job: replayed as the move of the job it took
TOOK = "the job"  # what a replayed dequeue must find in its queue
SCRIPTS = {b"EVALSHA", b"EVAL", b"FCALL"}  # the replies whose values a later request may carry back
BUSY = 0.9  # Redis's CPU over the replay's wall time from which the figure is the core's limit

BARE = "bare RQ job (no-op)"
OURS = "agentpool turn"
# A turn whose model call lasts LONG_CALL seconds holds its lease through renewals (one every lease TTL / 3,
# 15 s by default): recorded in time scaled by TIME_SCALE (the call and the lease TTL alike, so as many
# renewals fall in a turn) on a worker with LONG_THREADS threads, as a pool of long calls runs many at once.
LONG_CALL = 10.0
TIME_SCALE = 0.1
LONG_THREADS = 32
OURS_LONG = f"agentpool turn, {LONG_CALL:g} s model call"


Source = tuple[int, int, int]  # where a script made a value: its round trip, command and leaf of the reply


@dataclass
class Stream:
    """A recording ready to replay: its round trips as RESP in one buffer (a copy is one substitution
    over it, each prefix renamed at the same length, so every trip keeps its offsets), each trip's end, the
    connection it was sent on, and the kinds of reply the pool got."""

    data: bytes
    ends: list[int]
    on: list[int]  # each trip's connection, numbered from 0
    protocols: list[int]  # each connection's RESP version
    shapes: list[list[str]]
    names: list[list[str]]  # each trip's commands, named for what the table says of a reply unlike the recorded
    jobs: int  # turns (or bare jobs) it holds
    commands: int
    added: int  # commands the replay sends that the pool did not (a dequeue is a move of two)
    # Values a script made that the pool sent back later: where each was made -> (its leaf, the value,
    # where), and the trips that carry one -> (the value, where it was made).
    watch: dict[tuple[int, int], list[tuple[int, bytes, Source]]] = field(default_factory=dict)
    uses: dict[int, list[tuple[bytes, Source]]] = field(default_factory=dict)

    @classmethod
    def of(cls, trips: list[RoundTrip], jobs: int) -> Stream:
        buffer, ends, on, shapes, names, commands, added = bytearray(), [], [], [], [], 0, 0
        numbers: dict[int, int] = {}
        protocols: list[int] = []
        made: list[tuple[int, int, int, bytes]] = []  # (trip, command, leaf, value) of the scripts' replies
        for trip in _after_their_push(trips):
            kept = [
                (command, expected, reply)
                for recorded, reply in zip(trip.commands, trip.replies)
                for command, expected in _as_replayed(recorded, reply)
            ]
            if not kept:
                continue
            if trip.connection not in numbers:
                numbers[trip.connection] = len(numbers)
                protocols.append(trip.protocol)
            for k, (command, _, reply) in enumerate(kept):
                buffer += _resp(command)
                if command[0].upper() in SCRIPTS:
                    made += [(len(ends), k, i, v) for i, v in enumerate(_leaves(reply)) if 8 <= len(v) <= 200]
            ends.append(len(buffer))
            on.append(numbers[trip.connection])
            shapes.append([expected for _, expected, _ in kept])
            names.append([_named(command) for command, _, _ in kept])
            commands += len(kept)
            added += sum(1 for _, expected, _ in kept if expected == TOOK)  # a move is two commands, not one
        stream = cls(bytes(buffer), ends, on, protocols, shapes, names, jobs, commands, added)
        stream._carried_back(made)
        return stream

    def _carried_back(self, made: list[tuple[int, int, int, bytes]]) -> None:
        """Which of the scripts' reply values the pool sent in a later request, and in which. One value
        can be made twice (two leases taken in the same millisecond by one worker have one token): a request
        carries the one made last before it for the same run."""
        producers: dict[bytes, list[tuple[int, int, int]]] = {}
        for trip, k, leaf, value in made:
            if value not in producers and self.data.find(value, 0, self.ends[trip]) >= 0:
                continue  # the client sent it first: not the script's own making
            producers.setdefault(value, []).append((trip, k, leaf))
        for value, sources in producers.items():
            made_in = [trip for trip, _, _ in sources]
            used: set[Source] = set()
            at = self.data.find(value, self.ends[made_in[0]])
            while at >= 0:
                later = bisect.bisect_right(self.ends, at)
                made_before = sources[: bisect.bisect_left(made_in, later)]
                source = made_before[-1]  # the last made before it, or the last for the same run
                if len(made_before) > 1:
                    runs = self._runs_in(later)
                    source = next((s for s in reversed(made_before) if self._runs_in(s[0]) & runs), source)
                if (value, source) not in self.uses.setdefault(later, []):
                    self.uses[later].append((value, source))
                used.add(source)
                at = self.data.find(value, self.ends[later])
            for source in used:
                self.watch.setdefault(source[:2], []).append((source[2], value, source))

    def _runs_in(self, trip: int) -> set[bytes]:
        start = self.ends[trip - 1] if trip else 0
        return set(RUN_KEY.findall(self.data, start, self.ends[trip]))

    def calls_of(self, script: str) -> int:
        """How many times the recording calls ``script`` (by name, ``store/lua``)."""
        sha = run_script.sha(script)
        return sum(1 for names in self.names for name in names if name == f"EVALSHA {sha}")

    @property
    def round_trips(self) -> int:
        return len(self.ends)

    def copy(self, number: int) -> tuple[bytes, Callable[[bytes], bytes]]:
        """The stream in the keys of copy ``number``, and what renames a value so: ``ap:`` and ``rq:``
        become two prefixes of the copy's own, each two characters."""
        if number >= len(CODES) // 2:
            raise click.ClickException(f"at most {len(CODES) // 2} copies")
        new = {b"ap:": CODES[2 * number].encode() + b":", b"rq:": CODES[2 * number + 1].encode() + b":"}

        def rename(value: bytes) -> bytes:
            return PREFIXES.sub(lambda match: new[match.group()], value)

        return rename(self.data), rename


def _named(command: tuple[bytes, ...]) -> str:
    """A command as the table names it: its name and its first argument (a key, mostly), as recorded."""
    name = command[0].upper().decode()
    if len(command) < 2:
        return name
    return f"{name} {RUN_KEY.sub(rb'{run:...}', command[1][:60]).decode(errors='replace')}"


def _leaves(reply: object) -> list[bytes]:
    """A reply's strings, in order, through arrays and maps."""
    if isinstance(reply, bytes):
        return [reply]
    if isinstance(reply, dict):
        return [leaf for pair in reply.items() for part in pair for leaf in _leaves(part)]
    if isinstance(reply, (list, set)):
        return [leaf for part in reply for leaf in _leaves(part)]
    return []


def _after_their_push(trips: list[RoundTrip]) -> list[RoundTrip]:
    """The trips with each blocking dequeue moved after the request that pushed what it got. Redis answers a
    dequeue that waited as it runs the push that fed it, in the same instant, and the proxy may see that
    answer first; replayed in that order, the dequeue would find nothing to take."""
    dequeued = {
        trip.replies[0]: i
        for i, trip in enumerate(trips)
        if trip.commands[0][0].upper() in DEQUEUES and trip.replies and isinstance(trip.replies[0], bytes)
    }
    first_sent: dict[bytes, int] = {}  # a dequeued job's id -> the first trip that sent it (its push)
    for i, trip in enumerate(trips):
        for command in trip.commands:
            for arg in command[1:]:
                if arg in dequeued and arg not in first_sent:
                    first_sent[arg] = i
    order = {id(trip): (trip.seq, 0) for trip in trips}
    for job, i in dequeued.items():
        push = first_sent.get(job, -1)
        if push > i:
            order[id(trips[i])] = (trips[push].seq, 1)  # just after it
    return sorted(trips, key=lambda trip: order[id(trip)])


def _as_replayed(command: tuple[bytes, ...], reply: object) -> list[tuple[tuple[bytes, ...], str]]:
    """What a recorded command is replayed as, each with the kind of reply it must get.

    Left out: a connection's handshake, and a script call Redis did not know yet (the client loads the
    script and calls it again in its next round trip, which is replayed). A blocking dequeue becomes the
    move of the very job it got: the job out of the queue, into the list it was moved to. Redis runs
    requests that arrive together in an order no proxy sees, so two pushes to one queue may be replayed the
    other way round; a dequeue of the queue's head would then take another job than the recording's, and
    every later one of its copy too. One that timed out empty is replayed as a read of the queue's head,
    which takes nothing."""
    name = command[0].upper()
    if name in HANDSHAKE or (isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT")):
        return []
    if name in (b"BLMOVE", b"BRPOPLPUSH"):
        source, target = command[1], command[2]
        head, to = (command[3], command[4]) if name == b"BLMOVE" else (b"RIGHT", b"LEFT")
        if not isinstance(reply, bytes):
            return [((b"LINDEX", source, b"0" if head.upper() == b"LEFT" else b"-1"), "nil")]
        push = b"RPUSH" if to.upper() == b"RIGHT" else b"LPUSH"
        return [((b"LREM", source, b"1", reply), TOOK), ((push, target, reply), "number")]
    if name.startswith(b"B") and name[1:] in (b"LPOP", b"RPOP", b"ZPOPMIN", b"ZPOPMAX", b"LMPOP", b"ZMPOP"):
        raise click.ClickException(f"the recording has a blocking {name.decode()} the replay cannot send unblocked")
    return [(command, shape(reply))]


def _resp(command: tuple[bytes, ...]) -> bytes:
    return b"*%d\r\n" % len(command) + b"".join(b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in command)


@dataclass
class Replayed:
    """One replay of ``copies`` copies of a stream: what Redis did, and how it answered."""

    jobs: int
    seconds: float
    cpu_s: float
    commands: int  # every command Redis ran, a script's own calls among them (INFO commandstats)
    replies: int
    unlike: Counter[str]  # replies of another kind than the recorded one, by command and kinds

    @property
    def cpu_us(self) -> float:
        return self.cpu_s * 1e6 / self.jobs

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds

    @property
    def busy(self) -> float:
        return self.cpu_s / self.seconds


class _Copy:
    """One copy of the stream, a connection for each of the recording's, one round trip in flight."""

    def __init__(self, stream: Stream, number: int, server: _Server) -> None:
        self.stream = stream
        self.data, self.rename = stream.copy(number)
        self.socks = [_connect(server, protocol) for protocol in stream.protocols]
        self.reader = hiredis.Reader()
        self.trip, self.answered = 0, 0
        self.unlike: Counter[str] = Counter()  # replies of another kind than recorded, by command and kinds
        self.carried: dict[Source, bytes] = {}  # what this copy's scripts made where the recording's made a value

    def send(self) -> socket.socket:
        """Send the next round trip (with this copy's values for the scripts' own); the socket its answer
        will come on."""
        start = self.stream.ends[self.trip - 1] if self.trip else 0
        request = self.data[start : self.stream.ends[self.trip]]
        for value, source in self.stream.uses.get(self.trip, ()):
            if source in self.carried:
                request = request.replace(self.rename(value), self.carried[source])
        sock = self.socks[self.stream.on[self.trip]]
        sock.sendall(request)
        return sock

    def _learn(self, reply: object) -> None:
        """What this copy's script made where the recorded one made a value the pool sent back later."""
        leaves = _leaves(reply)
        for leaf, value, source in self.stream.watch[(self.trip, self.answered)]:
            if leaf < len(leaves) and len(leaves[leaf]) == len(value):  # the same length: offsets hold
                self.carried[source] = leaves[leaf]

    def receive(self, sock: socket.socket) -> socket.socket | None:
        """Read what came; the socket the next round trip's answer will come on, or None once the whole
        stream was answered (or until this one is)."""
        self.reader.feed(sock.recv(1 << 16))
        expected = self.stream.shapes[self.trip]
        while (reply := self.reader.gets()) is not False:
            got = shape(reply) if expected[self.answered] != TOOK else TOOK if reply == 1 else "the job gone"
            if (self.trip, self.answered) in self.stream.watch:
                self._learn(reply)
            if got != expected[self.answered]:
                name = self.stream.names[self.trip][self.answered]
                self.unlike[f"{name}: {expected[self.answered]} recorded, {got.split(' of ')[0]} replayed"] += 1
            self.answered += 1
            if self.answered == len(expected):
                self.trip, self.answered = self.trip + 1, 0
                return self.send() if self.trip < len(self.stream.ends) else None
        return sock

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@dataclass(frozen=True)
class _Server:
    """Where the lab's Redis listens, and what a connection of the replay says first (the handshake the
    recording's connections made is not replayed)."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    @classmethod
    def of(cls, lab: Lab) -> _Server:
        kwargs = lab.r.connection_pool.connection_kwargs
        if "host" not in kwargs or lab.url.startswith("rediss://"):
            raise click.ClickException(
                "bench --only capacity records through a TCP proxy: it needs a plain redis:// URL"
            )
        return cls(kwargs["host"], kwargs["port"], kwargs.get("db", 0), kwargs.get("username"), kwargs.get("password"))


def _connect(server: _Server, protocol: int) -> socket.socket:
    sock = socket.create_connection((server.host, server.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    handshake = []
    if server.password is not None:
        handshake.append((b"AUTH", *([server.username.encode()] if server.username else []), server.password.encode()))
    if server.db:
        handshake.append((b"SELECT", str(server.db).encode()))
    if protocol == 3:  # as the recorded connection spoke: its replies are RESP3
        handshake.append((b"HELLO", b"3"))
    reader = hiredis.Reader()
    for command in handshake:
        sock.sendall(_resp(command))
        while (reply := reader.gets()) is False:
            reader.feed(sock.recv(1 << 16))
        if isinstance(reply, hiredis.ReplyError):
            raise click.ClickException(f"the replay's {command[0].decode()} was refused: {reply}")
    return sock


def replay(lab: Lab, stream: Stream, copies: int) -> Replayed:
    """``copies`` copies of ``stream`` at once, each sending its next round trip as soon as its last is
    answered, against the lab's Redis; Redis's own figures from the first request to the last reply."""
    server = _Server.of(lab)
    lab.r.flushdb()  # the copies' keys from the replay before (the same names): each replay starts empty
    running = [_Copy(stream, n, server) for n in range(copies)]
    selector = selectors.DefaultSelector()
    cpu_before, calls_before = cpu_and_calls(lab.r)
    started = time.perf_counter()
    for each in running:
        selector.register(each.send(), selectors.EVENT_READ, each)
    left = copies
    while left:
        for key, _ in selector.select():
            each = key.data
            sock = each.receive(key.fileobj)
            if sock is not key.fileobj:
                selector.unregister(key.fileobj)
                if sock is None:
                    left -= 1
                else:
                    selector.register(sock, selectors.EVENT_READ, each)
    seconds = time.perf_counter() - started
    cpu_after, calls_after = cpu_and_calls(lab.r)
    for each in running:
        each.close()
    unlike = sum((each.unlike for each in running), Counter())
    return Replayed(
        jobs=copies * stream.jobs,
        seconds=seconds,
        cpu_s=cpu_after - cpu_before,
        # Less the two INFO before the count, and the second command of each dequeue replayed as a move.
        commands=calls_after - calls_before - 2 - copies * stream.added,
        replies=copies * stream.commands,
        unlike=unlike,
    )


# -- recording -------------------------------------------------------------------------------------


@dataclass
class _Recorded:
    """What one row records: its job, the worker it is recorded on (as the table says it, and its
    arguments), the load, and how long each model call takes."""

    job: str
    worker: str
    worker_args: tuple[str, ...]
    load: Callable[[Redis], Load]
    call_seconds: float = 0.0  # each model call's wait, in the recording's scaled time
    env: dict[str, str] = field(default_factory=dict)  # the worker's environment beside REDIS_URL


def _record(lab: Lab, row: _Recorded, jobs: int) -> Stream:
    """What a pool of one worker (``row.worker_args``) sends Redis for ``row.load``, given the client of
    the proxy to enqueue through."""
    server = _Server.of(lab)
    tap = Wiretap(server.host, server.port)
    load = row.load
    try:
        lab.reset({"redis": [{**step, "delay": row.call_seconds} for step in tool_steps(TURNS_PER_RUN)]})
        lab.start(*row.worker_args, REDIS_URL=tap.url_for(lab.url), **row.env)
        app = Redis.from_url(tap.url_for(lab.url))
        for recorded in (False, True):  # a first lot, not recorded: imports, connections, scripts loaded
            if recorded:
                tap.start()
            work, done = load(app)
            work()
            until(done, 120 + 5 * jobs, "the recorded jobs" if recorded else "the warm-up jobs", lab, poll=0.05)
        tap.stop()
        app.close()
        return Stream.of(tap.round_trips(), jobs)
    finally:
        lab.workers.stop()
        tap.close()


def bench_capacity(lab: Lab, turns: int, threads: int, copies: int, rounds: int) -> None:
    turns -= turns % TURNS_PER_RUN
    threaded = ("--concurrency", str(threads))

    def runs(app: Redis) -> Load:
        return runs_load(lab, turns, via=app)

    def bare(app: Redis) -> Load:
        return bare_load(lab, turns, via=app)

    recorded = [
        _Recorded(BARE, f"threaded (--concurrency {threads})", threaded, bare),
        _Recorded(OURS, f"threaded (--concurrency {threads})", threaded, runs),
        _Recorded(OURS, "forking (--concurrency 1)", (), runs),
        _Recorded(
            OURS_LONG,
            f"threaded (--concurrency {LONG_THREADS})",
            ("--concurrency", str(LONG_THREADS)),
            runs,
            call_seconds=LONG_CALL * TIME_SCALE,
            env={"AGENTPOOL_LEASE_TTL": f"{Settings.from_env().lease_ttl * TIME_SCALE:g}"},
        ),
    ]
    streams = [_record(lab, row, turns) for row in recorded]
    placement = _Placement(lab)
    results: list[list[Replayed]] = [[] for _ in recorded]
    try:
        placement.set(placement.can_isolate)
        for _ in range(rounds):
            for i, stream in enumerate(streams):
                results[i].append(replay(lab, stream, copies))
    finally:
        placement.set(False)
    rows, notes = [], []
    for (job, kind), stream, replays in zip(((row.job, row.worker) for row in recorded), streams, results):
        bare = results[0]
        ratios = [mine.cpu_us / theirs.cpu_us for mine, theirs in zip(replays, bare)]
        ours_threaded = job != BARE and kind.startswith("threaded")
        rows.append(
            [
                job,
                kind,
                f"{stream.round_trips / stream.jobs:.1f}",
                f"{statistics.median(r.commands for r in replays) / stream.jobs / copies:.1f}",
                spread([100 * r.busy for r in replays], ".0f", " %"),
                spread([r.cpu_us for r in replays], ".0f"),
                spread([r.rate for r in replays], ",.0f"),
                ">= 4,000" if ours_threaded else "",
                "" if job == BARE else spread(ratios, ".2f", "x"),
                f"{sum(r.unlike.total() for r in replays):,} of {sum(r.replies for r in replays):,}",
            ]
        )
        unlike = sum((r.unlike for r in replays), Counter())
        notes += [f"{job}, {kind}, unlike: {n:,} {what}" for what, n in unlike.most_common(3)]
        if min(r.busy for r in replays) < BUSY:
            notes.append(
                f"{job}, {kind}: Redis was busy {100 * min(r.busy for r in replays):.0f} % of a replay: the "
                "replaying process, not the core, set that rate, so the core carries at least that many"
            )
    forking = [f.cpu_us / t.cpu_us for f, t in zip(results[2], results[1])]
    # What a renewal costs: the long call's turn over the zero-latency one, per renewal it made, within a round.
    renewals = streams[3].calls_of("lease_renew") / streams[3].jobs
    acquired = streams[3].calls_of("lease_acquire") / streams[3].jobs  # more than 1: a lease lapsed, a takeover
    per_renewal = [(long.cpu_us - short.cpu_us) / max(renewals, 1e-9) for long, short in zip(results[3], results[1])]
    table(
        (
            f"capacity: a Redis core kept busy by {copies} copies of a recorded pool ({turns} turns, "
            f"{TURNS_PER_RUN} per run; bare RQ: {turns} jobs; {rounds} round{'s' if rounds > 1 else ''})"
        ),
        [
            "job",
            "worker recorded",
            "round trips",
            "commands",
            "Redis busy",
            "CPU µs",
            "turns/s per Redis core",
            "target",
            "CPU vs bare RQ",
            "replies unlike the recording",
        ],
        rows,
        (
            (
                "recorded through a proxy in front of Redis while one worker took the turns (an app enqueuing "
                "them through it too); replayed by copies of the recording, each in keys of its own and on "
                "connections of its own, a round trip at a time, all at once"
            ),
            (
                "Redis on a CPU of its own, the replaying process on the others"
                if placement.can_isolate
                else "Redis shares the CPUs with the replaying process (not started by this bench, or one CPU)"
            ),
            "round trips: a turn's requests as the workers sent them; commands: what Redis ran a turn, inside scripts too",
            (
                "Redis busy: Redis's CPU (INFO cpu, user + system) over the replay's wall time; near 100 % the "
                "turns/s is what the core carries, well under it the replaying process set the pace"
            ),
            "CPU µs: Redis's CPU per turn at that load; turns/s per Redis core: the turns replayed a second",
            (
                "replies unlike the recording: replies of another kind (error, nil, number, string, array and its "
                "length) than the pool got for the same request (the commonest below); what depends on Redis's "
                "clock differs, as the replay runs faster than the pool did: the reaper's lock (held 950 ms) is "
                "found still held, and the rate-limit settle's sweep of dead reservations (every few seconds) "
                "finds the copy's calls of the last second still there"
            ),
            (
                f"forking turn / threaded turn at capacity: CPU {spread(forking, '.2f', 'x')} "
                "(target: within 1.2x; at the workers' own pace, --only redis, Redis wakes up for each request)"
            ),
            (
                f"{OURS_LONG}: recorded {1 / TIME_SCALE:g} times faster than real (each call "
                f"{LONG_CALL * TIME_SCALE:g} s, the lease TTL {Settings.from_env().lease_ttl * TIME_SCALE:g} s), so "
                f"its turns hold their leases through as many renewals as a {LONG_CALL:g} s call: {renewals:.1f} "
                f"lease renewals a turn (one every TTL / 3, a worker's due together in one round trip), "
                f"{spread(per_renewal, '.1f')} µs of Redis CPU each over the zero-latency threaded turn's; "
                f"{acquired:.2f} lease acquisitions a turn (1: no lease lapsed in the scaled time); RQ's own "
                "heartbeats (every 30 s, not scaled) are left out"
            ),
            (
                f"{rounds} rounds, interleaved: each figure is the median of the rounds, with their range"
                if rounds > 1
                else "one round (--capacity-rounds 3 or more gives medians)"
            ),
            *notes,
        ),
    )
