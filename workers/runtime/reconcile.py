"""What to do with each pending tool_use, from its effect class and what the ledger recorded.

| class      | outcome recorded | intent only ("started")          | nothing       |
|------------|------------------|----------------------------------|---------------|
| read       | replay it        | run again                        | run           |
| idempotent | replay it        | run again with the *same* key    | run           |
| unsafe     | replay it        | verify hook, else report unknown | run           |

Before an idempotent call is run again or a verify hook is asked, the attempt the ledger records as
started must be unable to take effect any more (``running_until``): a worker frozen past its lease
(GC, SIGSTOP, a partition) may still be inside the tool, and a verify hook would truthfully answer
"not happened yet" while the first attempt is about to happen.
"""

from __future__ import annotations

import enum
import hashlib

from agentpool.store.ledger import Entry, Outcome


class Action(enum.Enum):
    REPLAY = "replay"  # use the recorded outcome
    RUN = "run"  # execute the tool (first time, or a safe repeat)
    VERIFY = "verify"  # ask the unsafe tool's verify hook whether the effect happened
    UNKNOWN = "unknown"  # tell the model the status is unknown; do not repeat


def plan(effect: str | None, entry: Entry, *, has_verify: bool) -> Action:
    """``effect`` is None when the agent no longer has a tool of that name."""
    if entry.outcome is not None:
        return Action.REPLAY
    if entry.intent is None:
        return Action.RUN
    if effect in ("read", "idempotent"):
        return Action.RUN
    return Action.VERIFY if has_verify and effect == "unsafe" else Action.UNKNOWN


def running_until(effect: str | None, entry: Entry, *, has_verify: bool, timeout: float, margin: float) -> float:
    """Until when (epoch seconds) the attempt the ledger records as started may still be running and
    take effect, if what ``plan`` decides must not overlap it; 0 when there is nothing to wait for.

    Only an idempotent call run again and an unsafe call's verify hook wait: a read runs again at once
    (no effect to overlap), and a replay, a first run or an "unknown" result start nothing. An attempt
    whose worker process is known to be gone with every process it started (``ended_at``, written by
    the hand-over of a dead work horse or worker process) waits for nothing. Otherwise the attempt may
    run until its start plus its tool's timeout (recorded in the intent; ``timeout`` for intents
    written before it was) plus ``margin`` (clock skew between machines, scheduling delays).
    """
    intent = entry.intent
    if intent is None or entry.outcome is not None or effect == "read":
        return 0.0
    if plan(effect, entry, has_verify=has_verify) not in (Action.RUN, Action.VERIFY):
        return 0.0
    started = intent.get("started_at")
    if intent.get("ended_at") is not None or not isinstance(started, int | float):
        return 0.0
    recorded = intent.get("timeout")
    return float(started) + float(recorded if isinstance(recorded, int | float) else timeout) + margin


def idempotency_key(run_id: str, tool_use_id: str) -> str:
    """Stable for one tool_use across every retry and worker; opaque to the tool's backend."""
    return "ap-" + hashlib.sha256(f"{run_id}/{tool_use_id}".encode()).hexdigest()[:40]


def unknown_outcome(name: str) -> Outcome:
    return Outcome(
        f"The status of this {name} call is unknown: the worker running it stopped before recording "
        "whether it took effect. It was not repeated automatically, to avoid doing it twice. Check "
        "whether it happened before calling it again.",
        True,
    )
