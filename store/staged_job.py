"""An RQ job as the plain Redis writes that enqueue it, so that a save point's script can make them.

The store does not import RQ (``agentpool.runtime.jobs`` builds the job with RQ and describes it
here); a script that commits a turn takes these writes as arguments and makes them with its own, so
the next turn's job lands exactly when the turn's results do, in one call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StagedJob:
    job_id: str
    job_key: str  # the job's hash
    job_fields: Mapping[str, Any]  # what RQ writes into it
    queue_key: str  # the RQ queue it is pushed onto
    queues_key: str  # RQ's set of queues (what `rq info` lists)
    register: bool = False  # add the queue to that set with the job
    at_front: bool = False  # push at the head of the queue
    header: Mapping[str, Any] = field(default_factory=dict)  # fields of the run's header that go with it
    header_key: str = ""  # the run's header, when ``header`` is not empty

    def stage(self, pipe: Any, *, with_header: bool = True) -> None:
        """The same writes, added to the caller's MULTI (``with_header``: the run's header fields too)."""
        if with_header and self.header:
            pipe.hset(self.header_key, mapping=dict(self.header))
        if self.register:
            pipe.sadd(self.queues_key, self.queue_key)
        pipe.hset(self.job_key, mapping=dict(self.job_fields))
        (pipe.lpush if self.at_front else pipe.rpush)(self.queue_key, self.job_id)


@dataclass(frozen=True)
class EndedJob:
    """The RQ job a turn runs in, as the writes that end it: its hash deleted and its execution's entry
    in the queue's started registry removed (what RQ's lean end does for a turn job, see
    ``agentpool.worker.lean``). Save point B makes them with its own, so the job's end costs no round
    trip of its own."""

    job_key: str
    registry_key: str  # the queue's started registry
    execution: str  # the execution's member there (``<job id>:<execution id>``)

    def stage(self, pipe: Any) -> None:
        pipe.delete(self.job_key)
        pipe.zrem(self.registry_key, self.execution)


def flat(mapping: Mapping[str, Any]) -> list[Any]:
    """``[count, field, value, ...]``: how a script takes a mapping."""
    return [len(mapping), *(x for item in mapping.items() for x in item)]
