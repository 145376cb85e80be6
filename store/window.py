"""A run's window: the messages its next request sends, from its latest compaction point on.

A compaction point is either an assistant message that starts with a ``compaction`` block (the API's
server-side compaction returned it, and wants it sent back as the first block of ``messages``) or a
summary message agentpool saved after asking the model for one (``commit_summary``). The message list
stays the whole conversation, append-only (``run.messages``, the audit trail); a turn loads and sends
only the window, so neither the load nor the request grows with the run's history.

The header's ``window`` is the index of the latest compaction point it knows of. A summary moves it in
the script that appends the summary (exact). A compaction block arrives inside a reply, and save point
A moves the window to it in the script that commits the reply (exact too: a reply that ends the run,
say in a chat with no tool call, has no save point B). The hint is never ahead; a record that a release
moving it only at save point B left behind is caught up by the next save point, and every load trims at
the latest compaction block it finds: what a request sends is right either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.client import Pipeline

from agentpool.store import writes
from agentpool.store.checkpoint import _check
from agentpool.store.clock import now_ms
from agentpool.store.errors import RunNotFound
from agentpool.store.events import Event, script_args
from agentpool.store.keys import STATS, RunKeys
from agentpool.store.records import (
    USAGE_FIELDS,
    RunState,
    load_header,
    message_meta,
    pack_message,
    unpack_message,
)
from agentpool.store.scripts import compact_source, run_script

if TYPE_CHECKING:
    from agentpool.store.spend import Rest


def is_compaction_point(message: Mapping[str, Any]) -> bool:
    """An assistant message whose first block is a compaction that produced a summary (a block with
    null content is a failed compaction, a no-op)."""
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, list) or not content:
        return False
    first = content[0]
    return isinstance(first, dict) and first.get("type") == "compaction" and first.get("content") is not None


def latest_point(messages: list[dict[str, Any]]) -> int:
    """Index in ``messages`` of the last message holding a compaction block; 0 when there is none."""
    for i in range(len(messages) - 1, 0, -1):
        if is_compaction_point(messages[i]):
            return i
    return 0


def stage_load(pipe: Pipeline, keys: RunKeys, *, start: int | None = None) -> None:
    """Add the reads of a run's header and window to ``pipe``; ``decode`` turns their replies into its
    state. ``start``: read the messages from there (a window start known from the turn before; the list
    is append-only, so from any index at or before the latest compaction point the window is the same
    once ``decode`` trims it); None: from the header's ``window`` (one script: the header, then the list)."""
    pipe.hgetall(keys.run)
    if start is None:
        pipe.eval(compact_source("load_window"), 2, keys.run, keys.messages)
    else:
        pipe.lrange(keys.messages, start, -1)


def decode(run_id: str, header: Mapping[bytes, bytes], reply: list[Any], *, start: int | None = None) -> RunState:
    """The state from the replies of ``stage_load`` (given the same ``start``): ``messages`` is the window,
    ``window_start`` its index in the whole conversation, ``last_reply`` the meta of the window's newest
    reply."""
    if not header:
        raise RunNotFound(run_id)
    if start is None:
        start, blobs = int(reply[0]), list(reply[1])
    else:
        blobs = list(reply)
    state = load_header(run_id, header)
    messages = [unpack_message(blob, start + i) for i, blob in enumerate(blobs)]
    cut = latest_point(messages)
    state.messages = messages[cut:]
    state.window_start = start + cut
    for i in range(len(blobs) - 1, cut - 1, -1):
        if messages[i]["role"] == "assistant":
            state.last_reply = message_meta(blobs[i], start + i)
            break
    # The newest call saved: that reply, or else the summary the window starts from (agentpool's own
    # compaction saves it as a user message).
    saved = state.last_reply or (message_meta(blobs[cut], start + cut) if cut < len(blobs) else {})
    state.last_call = str(saved.get("id") or "")
    return state


def load(r: Redis, run_id: str) -> RunState:
    """One round trip: the header and the window (what the next request sends)."""
    with r.pipeline(transaction=False) as pipe:
        stage_load(pipe, RunKeys.of(run_id))
        header, reply = pipe.execute()
    return decode(run_id, header, reply)


def start_of(state: RunState) -> int:
    """Where the window starts in a run loaded whole (``checkpoint.load_run``)."""
    hint = min(state.window_hint, len(state.messages))
    return hint + latest_point(state.messages[hint:])


def commit_summary(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    turns_before: int,
    index: int,
    message: Mapping[str, Any],
    meta: Mapping[str, Any],
    usage: Mapping[str, int],
    cost_usd: float,
    event: Event,
    ancestors: Sequence[str] = (),
    rest: Rest | None = None,
) -> None:
    """Save a summary as the run's new compaction point at ``index`` (the end of the message list),
    with the spend of the call that wrote it and the ``event`` that reports it. Fenced; a crash leaves
    the old window or the new one. The call's spend counts even when the summary can no longer be saved
    (the lease was lost or the run ended meanwhile): it was paid for; once, with a takeover's count of
    the call's note and the ``rest`` of it (as at save point A). A child run's spend counts in its
    ``ancestors``' tree counters too, in the same step."""
    code = run_script(
        "commit_summary",
        r,
        [keys.run, keys.lease, keys.messages, STATS, keys.events, *(RunKeys.of(a).run for a in ancestors)],
        [
            token,
            turns_before,
            index,
            pack_message(message, meta),
            now_ms(),
            *(int(usage.get(name) or 0) for name in USAGE_FIELDS),
            repr(float(cost_usd)),
            writes.new_id(),
            rest.script_arg() if rest else "",
            *script_args(event),
        ],
    )
    if int(code) not in (-4, -6, -7):  # type: ignore[arg-type]
        event.landed()
    if int(code) == -7 and rest:  # type: ignore[arg-type]
        rest.event.landed()
    _check(int(code), keys, r)  # type: ignore[arg-type]
