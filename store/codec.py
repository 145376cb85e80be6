"""msgpack on plain types only: no ext types, no pickle, ever.

Every text that goes into a record goes through ``safe_text`` (``pack`` does it for whole records):
a Python ``str`` can hold lone surrogates (``json.loads('"\\ud83d"')``, a cut emoji from a JSON API,
``surrogateescape`` decoding) that neither msgpack nor redis-py can encode as UTF-8. One such
character in a tool's result would otherwise make the turn unrecordable on every attempt.
"""

from __future__ import annotations

from typing import Any

import msgpack

from agentpool.store.errors import UnreadableRecord


def _refuse_ext(code: int, data: bytes) -> Any:
    # An ext type in our records means someone else wrote them; decoding it would be a guess.
    raise UnreadableRecord(f"msgpack ext type {code} is not allowed in agentpool records")


def safe_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD (a surrogate pair split over two code
    points is joined into its character). Costs one encode when the text is clean."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Through UTF-16: pairs become the character they encode, lone halves become U+FFFD.
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text


def scrub(value: Any) -> Any:
    """``value`` with ``safe_text`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


def pack(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True, strict_types=False)
    except UnicodeEncodeError:
        # Rare, so clean records pay nothing for the walk.
        return msgpack.packb(scrub(value), use_bin_type=True, strict_types=False)


def unpack(blob: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(blob, raw=False, ext_hook=_refuse_ext, strict_map_key=True)
    except UnreadableRecord:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise UnreadableRecord(f"{what} is not valid msgpack ({type(exc).__name__}: {exc})") from exc
