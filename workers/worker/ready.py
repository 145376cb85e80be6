"""Whether this machine's worker takes turns yet: what ``agentpool check --worker`` (a readiness probe)
asks, where ``agentpool check`` only asks whether Redis answers.

A worker process notes its RQ record here once RQ has registered it (``register_birth``), and drops the
note when it stops (``register_death``): a file ``<pid>.json`` in a private directory of this machine
(``AGENTPOOL_READY_DIR``, else one under the temporary directory), holding the record's key and the
Redis it is on as ``server_of`` names it (never a password). The probe counts a note only while its
process runs and its record is in Redis (RQ expires the record of a worker that stopped beating), so a
pod is ready once a worker in it took its place in the pool, not seconds before, and no longer once
it is gone. One file read and one ``EXISTS`` per note: a probe costs the same in a pool of any size.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

DIR_ENV = "AGENTPOOL_READY_DIR"


def directory() -> Path:
    configured = os.environ.get(DIR_ENV)
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"agentpool-ready-{os.getuid()}"


def note(worker_key: str, server: str) -> None:
    """This process's worker is registered in RQ as ``worker_key`` on ``server``. The notes of processes
    that died without dropping theirs (SIGKILL, the OOM killer) go now, so that on a machine nobody
    probes they do not pile up with every worker that was killed."""
    folder = directory()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    noted()
    path = folder / f"{os.getpid()}.json"
    part = path.with_suffix(".part")
    part.write_text(json.dumps({"pid": os.getpid(), "key": worker_key, "server": server}))
    part.replace(path)  # whole or not at all: a probe never reads half a note


def forget() -> None:
    with contextlib.suppress(OSError):
        (directory() / f"{os.getpid()}.json").unlink()


def noted() -> list[dict[str, Any]]:
    """The notes of worker processes that still run; a dead one's note is removed (a SIGKILLed worker
    never dropped it)."""
    found = []
    for path in sorted(directory().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _running(pid):
            found.append(entry)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return found


def _running(pid: int) -> bool:
    """Whether the process runs: not a zombie its parent (a supervisor) has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: whether the process id is taken
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
