"""What to do with each pending tool_use, from its effect class and what the ledger recorded.

| class      | outcome recorded | intent only ("started")          | nothing       |
|------------|------------------|----------------------------------|---------------|
| read       | replay it        | run again                        | run           |
| idempotent | replay it        | run again with the *same* key    | run           |
| unsafe     | replay it        | verify hook, else report unknown | run           |
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
