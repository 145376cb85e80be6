"""Starts a stdio MCP server so that it dies with the process that started it (Linux only).

The ``mcp`` SDK starts a stdio server in a session of its own (``start_new_session=True``), so ending a
dead worker's process group misses it: a server with a call in flight would go on and take effect after
the takeover told the model that call's status is unknown. So the hub starts each stdio server through
this launcher, ``python -I -S mcp_launch.py PARENT_PID PID_FILE COMMAND ARGS...``: it asks the kernel
for SIGKILL when its parent dies (PR_SET_PDEATHSIG, which survives the exec), writes its process id to
PID_FILE (the hub's way to see that the server exited while idle: a call is then not sent to it) and
then becomes the server (``os.execvp``: same process, so the SDK stops it as before). Elsewhere than
Linux the server is started as given (no pid file); where prctl is refused, it is only unwatched.

It runs by its path in the server's minimal environment (the SDK passes no PYTHONPATH), so it imports
the standard library only: not ``agentpool.worker.groups.die_with_parent``, which the runtime layer may
not import either.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def command_line(command: str, args: list[str], pid_file: str) -> tuple[str, list[str]]:
    """What to start instead of ``command args``, in the process that will be the server's parent."""
    if not sys.platform.startswith("linux"):
        return command, list(args)
    return sys.executable, ["-I", "-S", os.path.abspath(__file__), str(os.getpid()), pid_file, command, *args]


def die_with(parent: int) -> None:
    """SIGKILL to this process when ``parent`` dies; at once if it has died already."""
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no prctl here: the server runs unwatched
        return
    if os.getppid() != parent:  # it died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    parent, pid_file, command, *args = argv
    die_with(int(parent))
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    try:
        os.execvp(command, [command, *args])
    except OSError as exc:  # the SDK sees the connection close; the reason goes to the worker's stderr
        print(f"agentpool: cannot start the MCP server {command!r}: {exc}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
