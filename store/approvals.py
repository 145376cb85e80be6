"""Requests for a person's decision on a tool call, and the decisions, per run.

Field ``<tool_use_id>:wait`` holds the request (tool, input digest, when asked, deadline); field
``<tool_use_id>`` holds the decision (approved or not, reason, the input digest it was given for).
A decision is bound to its tool_use id and input: the turn checks the digest before the call runs.
The reason a person gives is sealed like the conversation it ends up in (encryption at rest), and
opened only when read: the reaper, which may run without the key, needs only that a decision exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from agentpool.store.codec import pack, unpack
from agentpool.store.keys import RunKeys
from agentpool.store.ledger import At, fenced_hset, input_digest
from agentpool.store.records import SCHEMA_VERSION, open_value, seal_value


@dataclass(frozen=True)
class Wait:
    tool_use_id: str
    name: str
    input_digest: str
    requested_at: float
    deadline: float | None  # epoch seconds; None waits for ever


@dataclass(frozen=True)
class Decision:
    approved: bool
    sealed_reason: dict[str, Any] = field(repr=False)  # {"plain": ...} or {"sealed": ...}, as seal_value makes
    input_digest: str
    at: float
    by: str  # "person" or "expiry"

    @property
    def reason(self) -> str:
        return str(open_value(self.sealed_reason, "approval reason") or "")


def request(
    r: Redis,
    keys: RunKeys,
    token: str,
    call: dict[str, Any],
    *,
    now: float,
    deadline: float | None,
    at: At | None = None,
) -> None:
    record = {
        "v": SCHEMA_VERSION,
        "name": call["name"],
        "input": input_digest(call["input"]),
        "requested_at": now,
        "deadline": deadline,
    }
    fenced_hset(r, keys, token, keys.approvals, f"{call['id']}:wait", record, at=at)


def read(r: Redis, keys: RunKeys) -> tuple[dict[str, Wait], dict[str, Decision]]:
    waits: dict[str, Wait] = {}
    decisions: dict[str, Decision] = {}
    for raw_name, blob in r.hgetall(keys.approvals).items():
        name = raw_name.decode()
        record = unpack(blob, f"approval record {name}")
        if name.endswith(":wait"):
            tool_use_id = name[: -len(":wait")]
            waits[tool_use_id] = Wait(
                tool_use_id, record["name"], record["input"], record["requested_at"], record.get("deadline")
            )
        else:
            # A record from before reasons were sealed keeps the reason in plain text under "reason".
            sealed = {k: record[k] for k in ("plain", "sealed") if k in record}
            decisions[name] = Decision(
                bool(record["approved"]),
                sealed or {"plain": record.get("reason") or ""},
                record["input"],
                record["at"],
                record.get("by", "person"),
            )
    return waits, decisions


def decision_record(wait: Wait, *, approved: bool, reason: str, now: float, by: str) -> bytes:
    return pack(
        {
            "v": SCHEMA_VERSION,
            "approved": approved,
            **seal_value(reason),
            "input": wait.input_digest,
            "at": now,
            "by": by,
        }
    )
