"""``agentpool worker`` serving several shards (``AGENTPOOL_SHARDS``): one worker process per shard, each
exactly what ``agentpool worker --shard N`` is, started and watched by this process.

RQ's worker has one connection, and everything a worker runs besides turns (its heartbeats, the lease
keeper, the reaper, a threaded worker's supervisor and its hand-over of a dead child's turns) is about
one Redis: so a shard is served by a process of its own, whose crash handling is that of any worker.
This process only forwards SIGTERM and SIGINT to them (once each: they run in sessions of their own, so
a terminal's Ctrl-C does not reach them twice, which RQ would take for a cold shutdown), restarts one
that dies (backing off if it keeps dying young), and ends when they have all ended after a shutdown,
or in ``--burst`` once each has emptied its shard's queues. Each dies with it (PR_SET_PDEATHSIG: a
warm shutdown) if it is SIGKILLed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

from agentpool.worker.groups import die_with_parent

log = logging.getLogger("agentpool.worker")

PARENT_ENV = "AGENTPOOL_WORKER_PARENT"  # set for a shard's worker process: the pid it must die with
HEALTHY_UPTIME = 30.0  # a shard's worker that lived this long was not dying young
MAX_BACKOFF = 30.0
POLL = 0.1


def adopted() -> None:
    """In a shard's worker process started here: end (warm) when this parent dies."""
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        die_with_parent(int(parent))


class ShardWorkers:
    """One ``agentpool worker --shard N ARGS`` process per shard in ``urls`` (shard number -> URL)."""

    def __init__(self, urls: Mapping[int, str], args: Sequence[str], *, burst: bool, name: str | None = None) -> None:
        self.urls, self.args, self.burst, self.name = dict(urls), list(args), burst, name
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, float] = {}
        self.restart_at: dict[int, float] = {}
        self.quick_deaths: dict[int, int] = dict.fromkeys(self.urls, 0)
        self.stopping = False
        self.failed = False

    def run(self) -> int:
        """Returns this process's exit status: 0 when every shard's worker ended well."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        for shard in self.urls:
            self._start(shard)
        while self.procs or (self.restart_at and not self.stopping):
            for shard, proc in list(self.procs.items()):
                if proc.poll() is not None:
                    del self.procs[shard]
                    self._ended(shard, proc.returncode)
            now = time.monotonic()
            for shard, at in list(self.restart_at.items()):
                if at <= now and not self.stopping:
                    del self.restart_at[shard]
                    self._start(shard)
            time.sleep(POLL)
        return 1 if self.failed else 0

    def _start(self, shard: int) -> None:
        env = {**os.environ, "REDIS_URL": self.urls[shard], PARENT_ENV: str(os.getpid())}
        self.procs[shard] = subprocess.Popen(
            [
                *(sys.executable, "-m", "agentpool", "worker", "--shard", str(shard)),
                *(("--name", f"{self.name}-s{shard}") if self.name else ()),
                *self.args,
            ],
            env=env,
            start_new_session=True,
        )
        self.started[shard] = time.monotonic()

    def _ended(self, shard: int, code: int) -> None:
        if self.stopping or (self.burst and code == 0):
            self.failed |= code != 0
            return
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        young = time.monotonic() - self.started[shard] < HEALTHY_UPTIME
        self.quick_deaths[shard] = self.quick_deaths[shard] + 1 if young else 0
        delay = 0.0 if self.quick_deaths[shard] <= 1 else min(MAX_BACKOFF, 0.5 * 2 ** (self.quick_deaths[shard] - 2))
        log.warning("worker of shard %d %s; starting another in %.1f s", shard, how, delay)
        self.restart_at[shard] = time.monotonic() + delay

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        for proc in self.procs.values():
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass
