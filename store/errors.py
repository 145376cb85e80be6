"""One error tree for agentpool. Whether an error is worth retrying is a property of its type."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class AgentPoolError(Exception):
    """Base of every error agentpool raises on purpose."""

    retryable = False


class RedisUnreachable(AgentPoolError, RedisConnectionError, RedisTimeoutError):
    """An API call could not reach Redis; the message names the server (without its password).
    Still a redis-py ``ConnectionError``/``TimeoutError`` for code that catches those. On a sharded
    pool ``shard`` is the number of the shard that did not answer, when one is to blame."""

    shard: int | None = None


class StoreError(AgentPoolError):
    """Something about the data in Redis is wrong."""


class RunNotFound(StoreError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run with id {run_id!r} (never created, or expired after its retention)")
        self.run_id = run_id


class RunExists(StoreError):
    """``enqueue_run`` was given the id of an existing run with another agent, task or limits."""

    def __init__(self, run_id: str, why: str) -> None:
        super().__init__(f"a run with id {run_id!r} already exists {why}; pick another id (nothing was changed)")
        self.run_id = run_id


class UnreadableRecord(StoreError):
    """A record could not be decoded: corrupt bytes, wrong shape, or the wrong encryption key."""


class SchemaTooNew(StoreError):
    """A record was written by a newer agentpool than this one; this worker must not touch it."""


class FenceError(StoreError):
    """A fenced write was refused: the writer no longer owns the run's lease."""


class LeaseLost(FenceError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"lost the lease on run {run_id}: another worker owns it now; stopping this turn")
        self.run_id = run_id


class TurnMoved(FenceError):
    """The run is not at the turn and phase the writer believes, although the lease is still its own: the
    server it now writes to lacks an earlier write of the turn (save point A lost in a failover, whose
    promoted replica had the lease already). Nothing was written; the turn is redone from what the
    server has."""

    def __init__(self, run_id: str, detail: str) -> None:
        super().__init__(f"run {run_id} is not where this turn left it ({detail}); the turn is redone from there")
        self.run_id = run_id


class RunNotActive(FenceError):
    """The run left the running state (cancelled, for instance) while this turn was in flight."""

    def __init__(self, run_id: str, status: str) -> None:
        super().__init__(f"run {run_id} is {status}; this turn commits nothing further")
        self.run_id = run_id
        self.status = status


class LedgerMismatch(StoreError):
    """The ledger holds a record for this tool_use id that names another tool or input."""


class MessagesWaiting(StoreError):
    """Save point A was asked to complete a run whose inbox holds messages: nothing was written; the
    reply is committed as a turn that goes on instead, and its save point B delivers them."""


class MessageRefused(AgentPoolError):
    """``send_message`` cannot deliver to this run (it was cancelled or failed, or a budget stopped it,
    or it completed at a limit, and its limits must be raised with ``resume`` first), or the
    ``message_id`` was already used for other content. The message says which; nothing was stored."""

    def __init__(self, run_id: str, why: str) -> None:
        super().__init__(f"message to run {run_id} refused: {why}")
        self.run_id = run_id
