"""Named fault points inside a turn, armed only by tests (and the demo's crash scenarios).

``AGENTPOOL_FAULTS="after_save_a,in_tool"`` arms points; each fires once per (point, run, turn), marked
by a file in ``AGENTPOOL_FAULT_DIR``, so the turn that takes over runs through. Firing SIGKILLs the
process that reaches the point: in a forking worker that is the work horse, exactly as the OOM killer
would. The points in ``SIGNALS`` send another signal instead (a deploy's SIGTERM, at a chosen instant).
Unarmed, ``fault()`` is one dict lookup.

The testing kit arms a point for one run instead (``LocalPool.enqueue(..., kill_at=...)``): with
``AGENTPOOL_FAULT_ARMS`` naming a directory, a file ``<point>-<run_id>`` there arms that point for that
run, once; its first line holds a tool's name (only that tool's call fires it) or nothing, and a
second line ``worker`` kills the process's parent with it (the worker of a work horse: a lost machine,
which leaves no one to say the attempt ended). The process that fires renames it ``fired-<point>-<run_id>-<pid>-<parent pid>`` before it dies, so the kit knows who was killed and
can fail a test in which nobody was.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINTS = (
    "before_model_call",  # lease held, checkpoint loaded, nothing asked yet
    "after_model_reply",  # the model answered (and billed us); save point A, which counts it, not written
    "after_save_a",  # response committed, no tool started
    "before_tool",  # a tool's intent is in the ledger (and on the replicas); the tool not yet started
    "in_tool",  # inside a tool, after its effect, before it returns
    "after_tool_outcome",  # a tool's outcome is in the ledger; save point B not written
    "after_save_b",  # tool results committed with the next job; this job not yet finished
    "mid_stream",  # the model's reply is streaming (its first delta arrived); nothing of it saved
    "after_partial_spend",  # a cut stream's tokens are counted; the turn is not yet deferred
    # A save or count carrying the turn's model call was refused (the lease lost, or the run ended); the
    # worker has not yet given the turn up.
    "after_spend_refused",
    "before_compaction",  # the window must be compacted; the summary call not yet made
    "after_summary_reply",  # the summary call answered (and billed us); the summary not saved
    "after_compaction_save",  # the summary is the new compaction point; the turn's model call not yet made
    "after_delivery_refused",  # save point A would have completed the run but messages wait: nothing saved
    "after_last_child_end",  # a child run's end is written and woke its parent; the parent's turn not queued
    # In the process that calls send_message / fork_run (an app), around its one transaction:
    "before_message_commit",
    "after_message_commit",
    "before_fork_commit",
    "after_fork_commit",
    # In a forking worker (not its horse): RQ's BLMOVE moved the turn's job to its intermediate queue;
    # no execution claims it yet. A SIGTERM (a deploy) lands here; or a SIGKILL.
    "after_dequeue",
    "after_dequeue_killed",
    # In either worker: the dequeued turn's job is claimed (in the started registry, out of the
    # intermediate queue); its run's lease not yet taken. A SIGKILL of the worker (a lost machine).
    "after_claim_killed",
    # In a worker's webhook thread (``turn`` is the delivery's number): the receiver answered 2xx; that
    # it did is not yet recorded, so the delivery is made again by another worker (a duplicate).
    "after_webhook_answered",
)
SIGNALS = {"after_dequeue": signal.SIGTERM}

_ARMED = frozenset(p for p in os.environ.get("AGENTPOOL_FAULTS", "").split(",") if p)
if _ARMED - set(POINTS):
    raise RuntimeError(f"unknown fault points in AGENTPOOL_FAULTS: {sorted(_ARMED - set(POINTS))}")
# The points a tool's call passes, which an arming file may restrict to one tool.
TOOL_POINTS = ("before_tool", "in_tool", "after_tool_outcome")
_ARMS = os.environ.get("AGENTPOOL_FAULT_ARMS") or None


def fault(point: str, run_id: str, turn: int, *, tool: str | None = None) -> None:
    if point not in _ARMED:
        if _ARMS is not None:
            _fire_if_armed_for(point, run_id, tool)
        return
    marker = Path(os.environ.get("AGENTPOOL_FAULT_DIR", "/tmp")) / f"fault-{point}-{run_id}-{turn}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), SIGNALS.get(point, signal.SIGKILL))


def _fire_if_armed_for(point: str, run_id: str, tool: str | None) -> None:
    armed = Path(_ARMS or ".") / f"{point}-{run_id}"
    try:
        wanted, *options = armed.read_text().split("\n")
    except OSError:
        return
    if wanted and wanted != tool:
        return
    try:  # one process wins the rename: a point armed once fires once
        os.rename(armed, armed.with_name(f"fired-{point}-{run_id}-{os.getpid()}-{os.getppid()}"))
    except OSError:
        return
    if "worker" in options:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
