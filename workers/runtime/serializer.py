"""RQ job payloads as msgpack: a turn job carries only the run id and turn number. No pickle."""

from __future__ import annotations

from typing import Any

from agentpool.store.codec import pack, unpack


class MsgpackSerializer:
    """Give this to RQ queues and workers (``rq worker -S agentpool.runtime.serializer.MsgpackSerializer``)."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        # RQ serializes (func_name, instance, args, kwargs); tuples become lists, which RQ accepts.
        return pack(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return unpack(data, "RQ job payload")
