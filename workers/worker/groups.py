"""Ending what a dead turn holder left running: the processes of its process group.

A forking worker's work horse leads its own process group (RQ calls ``setpgrp()`` in it), and so does
the threaded worker process the supervisor forks (``agentpool.worker.supervisor``). A tool's
subprocesses inherit that group unless they leave it (``start_new_session=True``, ``setsid``, a
daemon's double fork). When the holder dies, its turns are handed to another worker, which may run a
call again or ask its ``verify`` hook: before that, every process of the group must be gone, or a
subprocess that handles SIGTERM could still take effect after the new holder was told "not happened".
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("agentpool.worker")

POLL = 0.02
KILL_TIMEOUT = 5.0  # after SIGKILL: a member still alive then is stuck in the kernel (D state)


def live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are not zombies (a zombie takes no effect), from /proc.
    Elsewhere than Linux: [pgid] while ``killpg(pgid, 0)`` finds the group, else []."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def end_process_group(pgid: int, grace: float, *, reap: bool = False) -> bool:
    """SIGTERM every process of group ``pgid`` (a well-behaved tool subprocess cleans up), SIGKILL what is left after ``grace`` seconds,
    and return once none is left: True, or False if some member outlived even SIGKILL for
    ``KILL_TIMEOUT`` seconds (logged). With ``reap``, collects any child of this process that ended
    meanwhile (in a container the supervisor may be PID 1, every orphan's parent); only for a process
    with no child of its own to wait for."""
    if not _signal_group(pgid, signal.SIGTERM):
        return True
    deadline = time.monotonic() + grace
    killed_at: float | None = None
    while True:
        if reap:
            reap_children()
        members = live_members(pgid)
        if not members:
            return True
        now = time.monotonic()
        if killed_at is None and now >= deadline:
            log.warning("process group %d still has %s after SIGTERM; SIGKILL", pgid, members)
            if not _signal_group(pgid, signal.SIGKILL):
                return True
            killed_at = now
        elif killed_at is not None and now - killed_at > KILL_TIMEOUT:
            log.error("process group %d: %s survived SIGKILL for %.0f s", pgid, members, KILL_TIMEOUT)
            return False
        time.sleep(POLL)


def _signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed user; the others got it
        pass
    return True


def reap_children() -> None:
    """Collect the exit status of any child of this process that has ended, so it leaves its group."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class GroupWatcher:
    """A small process beside a forking worker that SIGKILLs the current work horse's process group when
    the worker dies without ending it (SIGKILL, the OOM killer). The horse itself dies with its worker
    (PR_SET_PDEATHSIG), but that signal reaches only the horse: a tool's subprocess would run on with
    nobody left to end it. The worker tells the watcher each horse's group as it forks it, and 0 once
    that group is ended; the watcher learns of the worker's death from the end of that pipe (its last
    holder gone), so nothing depends on the worker or the horse running another line of Python.
    Started lazily, in the worker's process group (not a horse: it leads no group of its own)."""

    def __init__(self) -> None:
        self._fd: int | None = None  # the pipe's write end, which a forked horse must close

    def watch(self, pgid: int) -> None:
        """A horse leads group ``pgid`` now (0: no horse, its group ended)."""
        if self._fd is None:
            if pgid == 0:
                return
            self._fd = _start_watcher()
        try:
            os.write(self._fd, b"%d\n" % pgid)
        except OSError:  # the watcher is gone (killed by hand): start another at the next horse
            os.close(self._fd)
            self._fd = None

    def close_in_child(self) -> None:
        """In a forked horse: drop the write end, or the watcher would see no end when the worker dies."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _start_watcher() -> int:
    read_end, write_end = os.pipe()
    if os.fork():
        os.close(read_end)
        return write_end
    # The watcher: only os calls from here on (the worker may have had threads holding locks at the fork).
    try:
        os.close(write_end)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C or a SIGTERM for the worker's group:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the watcher ends when the worker does
        current, pending = 0, b""
        while data := os.read(read_end, 4096):
            pending += data
            *lines, pending = pending.split(b"\n")
            if lines:
                current = int(lines[-1])
        if current:  # the worker died while a horse was running: end what that horse left
            _signal_group(current, signal.SIGKILL)
    finally:
        os._exit(0)


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Linux: ``sig`` to this process when ``parent`` dies (PR_SET_PDEATHSIG), so a SIGKILLed worker
    or supervisor leaves nothing it started running unwatched. Elsewhere nothing: such a process still
    works, only unwatched (its turns are fenced once the lease moves on)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # it died before the request was made
            os.kill(os.getpid(), sig)
