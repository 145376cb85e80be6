"""The spend of a model call that produced nothing to commit: a stream cut before its message ended.

Save point A counts a complete call's spend with its response. A stream cut midway (the connection
lost, the idle timeout, an ``error`` event after the 200) was billed for the tokens it had reported
(``message_start``'s usage, then each ``message_delta``'s cumulative usage); its partial output is
never committed, its spend is counted here, once, under the turn's lease.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from redis import Redis

from agentpool.store.checkpoint import _check
from agentpool.store.events import Event, script_args
from agentpool.store.keys import STATS, RunKeys
from agentpool.store.records import USAGE_FIELDS
from agentpool.store.scripts import run_script


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
) -> bool:
    """Add ``usage`` and ``cost_usd`` to the run's counters with ``event``. ``spend_id`` names the call:
    delivered twice, it counts once. Returns False when it had been counted already. A worker fenced out
    meanwhile still counts it (the call was paid for), then gets ``LeaseLost``. A child run's spend counts
    in its ``ancestors``' tree counters too, in the same step."""
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
                *script_args(event),
            ],
        )
    )
    if code == 1:
        event.landed()
    _check(code, keys, r)
    return code == 1
