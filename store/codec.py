"""msgpack on plain types only: no ext types, no pickle, ever."""

from __future__ import annotations

from typing import Any

import msgpack

from agentpool.store.errors import UnreadableRecord


def _refuse_ext(code: int, data: bytes) -> Any:
    # An ext type in our records means someone else wrote them; decoding it would be a guess.
    raise UnreadableRecord(f"msgpack ext type {code} is not allowed in agentpool records")


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, strict_types=False)


def unpack(blob: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(blob, raw=False, ext_hook=_refuse_ext, strict_map_key=True)
    except UnreadableRecord:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise UnreadableRecord(f"{what} is not valid msgpack ({type(exc).__name__}: {exc})") from exc
