"""The checks every entry point shares (the client, the CLI, the dashboard): one for every number that
bounds a run (a limit, an amount ``resume`` adds, a timeout), and one for the name of who acted.

``NaN`` passes every comparison silently (``cost >= nan`` is always False, ``min(0, nan)`` is 0), JSON
and click both accept it, and ``True`` is an ``int`` to Python: so the agent definition, ``enqueue_run``,
``resume``, the CLI and the dashboard all go through :func:`limit_value`, which lets through only
finite numbers in range, and says which one is wrong otherwise.
"""

from __future__ import annotations

import math
import re
from typing import Any

from agentpool.store.errors import AgentPoolError

# Counts are stored as msgpack integers and shown by the dashboard's JavaScript: stay exact in both.
MAX_WHOLE = 2**53


class InvalidLimit(AgentPoolError, ValueError):
    """A limit, an amount added by ``resume`` or a timeout that is not a finite number in range."""


def limit_value(name: str, value: Any, *, whole: bool = False, zero_ok: bool = False) -> Any:
    """``value`` if it is a finite number > 0 (>= 0 with ``zero_ok``), as an ``int`` when ``whole``;
    otherwise an :class:`InvalidLimit` naming ``name``. A float with a whole value (``10.0``, as JSON
    may send it) is accepted for a whole number."""
    wanted = (
        f"a whole number {'>= 0' if zero_ok else '>= 1'}"
        if whole
        else f"a finite number {'>= 0' if zero_ok else 'greater than 0'}"
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidLimit(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise InvalidLimit(f"{name} must be {wanted}, got {value!r}")
    if whole:
        if value != int(value):
            raise InvalidLimit(f"{name} must be {wanted}, got {value!r}")
        value = int(value)
        if value > MAX_WHOLE:
            raise InvalidLimit(f"{name} must be at most {MAX_WHOLE}, got {value}")
    if value < 0 or (value == 0 and not zero_ok):
        raise InvalidLimit(f"{name} must be {wanted}, got {value!r}")
    return value


def optional_limit(name: str, value: Any, *, whole: bool = False) -> Any:
    """:func:`limit_value`, with ``None`` meaning "no limit"."""
    return None if value is None else limit_value(name, value, whole=whole)


# Who acted (decided on a call, cancelled, resumed, sent a message, forked), as the run's events keep it:
# a person's or a service's name, an email address. An approval says "person" when nobody said; "expiry"
# is the reaper's, for an approval whose deadline passed.
ACTOR = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}")
EXPIRY = "expiry"


def check_actor(by: str) -> str:
    """``by`` as given, or a ``ValueError`` saying what a name may hold."""
    if not isinstance(by, str) or not ACTOR.fullmatch(by):
        raise ValueError(
            f"by={by!r}: who acts is named with up to 100 letters, digits and . _ @ + - (starting with a "
            "letter or digit), such as alice or ops-bot@example.com"
        )
    if by == EXPIRY:
        raise ValueError(f"by={by!r} is kept for the calls whose approval expired; name who acts")
    return by


def optional_actor(by: str | None) -> str | None:
    """:func:`check_actor`, with ``None`` meaning "nobody named" (the events then say nothing of who)."""
    return None if by is None else check_actor(by)
