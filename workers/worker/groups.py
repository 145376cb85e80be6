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


# Sent by the kernel to a work horse whose worker died: its handler ends the horse's whole group.
GROUP_DEATH_SIGNAL = signal.SIGRTMIN + 3


def die_with_parent_and_group(parent: int) -> None:
    """Like ``die_with_parent``, for the leader of a process group (a work horse): when ``parent`` dies,
    this process SIGKILLs its whole group, itself included, so a tool's subprocess does not run on
    once nobody watches it (PR_SET_PDEATHSIG reaches only this process, and SIGKILL cannot be caught).
    The handler runs in the main thread at its next bytecode; the turn's blocking calls (a socket
    read, a wait on a tool's thread) are interrupted for it."""
    signal.signal(GROUP_DEATH_SIGNAL, _end_own_group)
    die_with_parent(parent, GROUP_DEATH_SIGNAL)


def _end_own_group(_signum: int, _frame: object) -> None:
    if os.getpgrp() == os.getpid():
        _signal_group(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


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
