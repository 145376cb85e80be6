"""The spend of a model call that produced nothing to commit: a stream cut before its message ended,
or a call whose worker died before saving it.

Save point A counts a complete call's spend with its response. A stream cut midway (the connection
lost, the idle timeout, an ``error`` event after the 200) was billed for the tokens it had reported
(``message_start``'s usage, then each ``message_delta``'s cumulative usage); its partial output is
never committed, its spend is counted here, once, under the turn's lease.

A worker killed during a call (or after its reply, before save point A) counts nothing itself. So a
streamed call notes itself as it begins to be billed (``note_call``, at ``message_start``: the API's
id for it, the model, the usage reported so far), and the turn that takes the run over counts a noted
call that no saved message carries (``lost_call``): its input and cache tokens, that is, and the
output reported at its start (the output it produced after that is not known to anyone but the API).

The call's worker may be alive all the same (frozen, or cut off by a silent connection, past its
lease): its save is then refused without counting the call again, and that worker, which knows the
whole usage and the note it made, gives the difference with the save (``Rest``, ``Turn.rest_of_call``):
the refusing script counts it under the spend id ``call:<API id>:rest`` (``store/lua/_rest.lua``). In the
refused write itself, not one of its own after it, which a worker killed or cut off from Redis between
the two would never make.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redis import Redis

from agentpool.store import writes
from agentpool.store.checkpoint import _check
from agentpool.store.codec import pack
from agentpool.store.events import Event, script_args
from agentpool.store.keys import STATS, RunKeys
from agentpool.store.records import USAGE_FIELDS
from agentpool.store.scripts import run_script

NOTE_TTL_MS = 24 * 3600 * 1000  # a takeover comes within minutes; the note of a saved call is only compared


@dataclass(frozen=True)
class Rest:
    """What a worker knows of its own call ``call_id`` beyond the note it made (``usage``, ``cost_usd``:
    the whole call's less the note's), reported by ``event`` (``spend_corrected``). Given with the call's
    save, or its cut stream's count: counted there only if the turn that took the run over counted the
    call from the note."""

    call_id: str
    usage: Mapping[str, int]
    cost_usd: float
    event: Event

    def script_arg(self) -> bytes:
        """The one argument ``count_rest`` in ``store/lua/_rest.lua`` reads (no rest: ``""``): packed, so
        that the saves that are not refused, nearly all, pass Redis one string, not two dozen."""
        return pack(
            [
                f"call:{self.call_id}:rest",
                *(str(int(self.usage.get(name) or 0)) for name in USAGE_FIELDS),
                repr(float(self.cost_usd)),
                *(str(x) for x in script_args(self.event)),
            ]
        )


def note_call(r: Redis, keys: RunKeys, *, call_id: str, model: str, usage: Mapping[str, int]) -> None:
    """A call's reply began (``message_start``): it is billed from now on. One command, not fenced: a
    zombie's call was paid for too, and the note is never a record a reader of the run relies on.
    ``<id> <model> <input> <output> <cache read> <cache write>`` (neither an id nor a model has spaces)."""
    counts = " ".join(str(int(usage.get(name) or 0)) for name in USAGE_FIELDS)
    r.set(keys.call, f"{call_id} {model} {counts}", px=NOTE_TTL_MS)


def lost_call(raw: bytes | None, last_saved: str) -> tuple[str, str, dict[str, int]] | None:
    """(the API's id, model, usage) of the noted call if no saved message carries it (``last_saved``: the
    newest call the run's window holds); None if there is none, or the note is not one."""
    try:
        call_id, model, *counts = (raw or b"").decode().split(" ")
        usage = dict(zip(USAGE_FIELDS, (int(n) for n in counts), strict=True))
    except ValueError:  # no note (or not one: a note is only ever compared, never trusted further)
        return None
    return None if not call_id or call_id == last_saved else (call_id, model, usage)


def forget_call(r: Redis, keys: RunKeys, call_id: str) -> None:
    """The noted call ``call_id`` is counted: a takeover must not count it again (a note written since,
    by another attempt, stays)."""
    run_script("forget_call", r, [keys.call], [call_id])


def count_spend(
    r: Redis,
    keys: RunKeys,
    token: str,
    *,
    spend_id: str,
    usage: Mapping[str, int],
    cost_usd: float,
    event: Event,
    ancestors: Sequence[str] = (),
    rest: Rest | None = None,
) -> bool:
    """Add ``usage`` and ``cost_usd`` to the run's counters with ``event``. ``spend_id`` names the call:
    delivered twice, or counted by a takeover (from the call's note) and by its fenced-out worker too, it
    counts once; then the ``rest`` of it (the worker's own call, given) counts instead, once. Returns
    False when the call had been counted already. A worker fenced out meanwhile still counts it (the
    call was paid for), then gets ``LeaseLost``. A child run's spend counts in its ``ancestors``' tree
    counters too, in the same step."""
    code = int(
        run_script(  # type: ignore[arg-type]
            "count_spend",
            r,
            [keys.run, keys.lease, STATS, keys.events, *(RunKeys.of(a).run for a in ancestors)],
            [
                token,
                spend_id,
                *(int(usage.get(name) or 0) for name in USAGE_FIELDS),
                repr(float(cost_usd)),
                writes.new_id(),
                rest.script_arg() if rest else "",
                *script_args(event),
            ],
        )
    )
    if code in (1, -1):  # counted by this write (-1: and the lease is lost)
        event.landed()
    elif code in (2, -7) and rest:  # counted already, from the call's note: its rest by this write
        rest.event.landed()
    _check(code, keys, r)
    return code == 1
