"""One check for every number that bounds a run: a limit, an amount ``resume`` adds, a timeout.

``NaN`` passes every comparison silently (``cost >= nan`` is always False, ``min(0, nan)`` is 0), JSON
and click both accept it, and ``True`` is an ``int`` to Python: so the agent definition, ``enqueue_run``,
``resume``, the CLI and the dashboard all go through :func:`limit_value`, which lets through only
finite numbers in range, and says which one is wrong otherwise.
"""

from __future__ import annotations

import math
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
