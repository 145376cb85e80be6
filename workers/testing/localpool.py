"""A whole pool on one machine, for the demo, the benchmarks and the tests: a redis-server (if none
is given), the scripted model, and real ``agentpool worker`` processes that can be killed for real."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from redis import Redis
from redis.exceptions import RedisError

PORTS_FROM = 10_000  # the lowest port free_port hands out
_pick = random.SystemRandom()  # not the random module's state: a test run may seed it alike in every process


def _ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (and bind to port 0)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A port nobody listens on now, for a server about to start. Not one from the ephemeral range: any
    outgoing connection on the machine (a worker's to Redis) can be given such a port between this call
    and the server's bind, and the server then fails with "Address already in use"."""
    ephemeral = _ephemeral_ports()
    for _ in range(200):
        port = _pick.randrange(PORTS_FROM, 65536)
        if port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # someone listens there (or did a moment ago)
            return port
    with socket.socket() as s:  # every pick was taken: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisNotInstalled(RuntimeError):
    pass


class RedisServer:
    """A throwaway redis-server on a free port. ``durable`` turns on AOF (appendfsync everysec) as
    deploy/redis.conf does, so a restart keeps what was committed."""

    def __init__(
        self,
        workdir: Path,
        *,
        durable: bool = False,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        url: str | None = None,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalled(
                "redis-server is not installed; install it (Debian/Ubuntu: apt-get install -y redis-server, "
                "macOS: brew install redis) or point REDIS_URL at a running server"
            )
        self.binary, self.workdir, self.durable = binary, workdir, durable
        self.port = port or free_port()
        self.extra_args = extra_args  # TLS, ACL users...: then give the ``url`` clients must use
        self.url = (url or "redis://127.0.0.1:{port}/0").format(port=self.port)
        self.wrapper = wrapper  # a command the server runs under (valgrind...)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.workdir / f"redis-server-{self.port}.log"  # two servers may share a workdir

    def log_tail(self, lines: int = 20) -> str:
        """The end of the server's log, for an error that says why it would not start or sync."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> RedisServer:
        args = [
            *self.wrapper,
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            # A primary's first sync to a replica waits 5 s by default (for more replicas to share it);
            # a replica of a replica waits for that sync, then 5 s more: 10 s idle, past 30 s on a loaded
            # machine, before a replicated test can begin.
            "--repl-diskless-sync-delay",
            "0",
            "--logfile",
            str(self.log),
        ]
        args += ["--appendonly", "yes", "--appendfsync", "everysec"] if self.durable else ["--appendonly", "no"]
        args += self.extra_args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = Redis.from_url(self.url)
        try:
            for _ in range(500):
                try:
                    client.ping()  # refused while an AOF loads
                    # The answer must come from this server: one that found its port taken (another
                    # process bound it between free_port() and now) exits, and the ping reaches the other.
                    if int(client.info("server")["process_id"]) == self.proc.pid:
                        return self
                except RedisError:
                    pass
                if self.proc.poll() is not None:
                    break  # it exited (its port taken, a bad argument): its log says why
                time.sleep(0.02)
        finally:
            client.close()
        self.stop(signal.SIGKILL)  # not left running for the garbage collector to warn about
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


def redis_answers(url: str) -> bool:
    client = Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except RedisError:
        return False
    finally:
        client.close()


def _children(pid: int) -> list[tuple[int, int]]:
    """(pid, process group) of each child process of ``pid``, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        if int(fields[1]) == pid:
            children.append((int(entry.name), int(fields[2])))
    return children


def children_of(pid: int) -> list[int]:
    """Child processes of ``pid``: its work horse (and any other child, such as a tool's process). The
    horse calls setpgrp(), so killing a worker's process group misses it: a test or demo that means
    "this machine died" kills them all."""
    return [child for child, _group in _children(pid)]


def horses_of(pid: int) -> list[int]:
    """The work horse(s) of worker ``pid``: the children that lead their own process group."""
    return [child for child, group in _children(pid) if group == child]


class WorkerProcesses:
    """``agentpool worker`` processes sharing one environment."""

    def __init__(self, env: dict[str, str], logdir: Path, cwd: str | None = None) -> None:
        self.env, self.logdir, self.cwd = env, logdir, cwd
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, n: int = 1, *args: str, **env: str) -> list[subprocess.Popen[bytes]]:
        started = []
        for _ in range(n):
            log = open(self.logdir / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed by stop()
            self._logs.append(log)
            proc = subprocess.Popen(
                [sys.executable, "-m", "agentpool", "worker", *args],
                env={**self.env, **env},
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.procs.append(proc)
            started.append(proc)
        return started

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL, *, with_horse: bool = True) -> None:
        targets = children_of(proc.pid) if with_horse else []
        for pid in [proc.pid, *targets]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            proc.wait(timeout=10)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc, sig)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def dump_stacks(self, settle: float = 1.0) -> None:
        """Every worker process (and its forked child: a work horse, a supervised threaded worker) writes
        its threads' stacks to its log (``agentpool worker`` registers SIGUSR2 for that)."""
        for proc in self.alive():
            for pid in [proc.pid, *children_of(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGUSR2)
                except ProcessLookupError:
                    pass
        time.sleep(settle)

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(p.read_text(errors="replace")[-tail:] for p in sorted(self.logdir.glob("worker-*.log")))


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
