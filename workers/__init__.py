"""agentpool: durable Claude agent runs on a pool of RQ workers over Redis.

The public API. Below it, in layers that import only downwards (checked by the tests, see
``pyproject.toml``): ``agentpool.ops`` (the CLI, dashboard, metrics, demo, bench), ``agentpool.worker``
(the processes that run turns) beside ``agentpool.client`` (what apps call) and ``agentpool.watching``
(following a run live), ``agentpool.runtime`` (one
turn), the definitions apps write (``agent``, ``tools``, ``context``, ``pricing``) and ``agentpool.store``
(Redis). ``agentpool.testing`` is a kit for tests.

Each public name is imported when first used, not with the package: ``import agentpool.ops.cli`` (the
``agentpool`` command) must not pay for the anthropic SDK and pydantic when it only reads Redis.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentpool.agent import Agent, Compaction, Subagent
    from agentpool.checks import InvalidLimit
    from agentpool.client import (
        ResumeRefused,
        Run,
        RunTimeout,
        approve,
        cancel_run,
        enqueue_run,
        get_run,
        list_runs,
        resume,
        wait_for_run,
    )
    from agentpool.context import CallNotOwned, ToolCall, current_call
    from agentpool.conversation import fork_run, send_message
    from agentpool.pricing import set_price
    from agentpool.runtime.approvals import ApprovalError
    from agentpool.runtime.settings import connect
    from agentpool.runtime.shards import Shards
    from agentpool.store.crypto import EncryptionKeyMissing
    from agentpool.store.errors import (
        AgentPoolError,
        MessageRefused,
        RedisUnreachable,
        RunExists,
        RunNotFound,
        SchemaTooNew,
        StoreError,
        UnreadableRecord,
    )
    from agentpool.tools import Tool, ToolInputError, tool
    from agentpool.watching import watch

# Where each public name lives.
_HOMES = {
    "agentpool.agent": ("Agent", "Compaction", "Subagent"),
    "agentpool.checks": ("InvalidLimit",),
    "agentpool.client": (
        "ResumeRefused",
        "Run",
        "RunTimeout",
        "approve",
        "cancel_run",
        "enqueue_run",
        "get_run",
        "list_runs",
        "resume",
        "wait_for_run",
    ),
    "agentpool.context": ("CallNotOwned", "ToolCall", "current_call"),
    "agentpool.conversation": ("fork_run", "send_message"),
    "agentpool.pricing": ("set_price",),
    "agentpool.runtime.approvals": ("ApprovalError",),
    "agentpool.runtime.settings": ("connect",),
    "agentpool.runtime.shards": ("Shards",),
    "agentpool.store.crypto": ("EncryptionKeyMissing",),
    "agentpool.store.errors": (
        "AgentPoolError",
        "MessageRefused",
        "RedisUnreachable",
        "RunExists",
        "RunNotFound",
        "SchemaTooNew",
        "StoreError",
        "UnreadableRecord",
    ),
    "agentpool.tools": ("Tool", "ToolInputError", "tool"),
    "agentpool.watching": ("watch",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'agentpool' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once: the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "Agent",
    "AgentPoolError",
    "ApprovalError",
    "CallNotOwned",
    "Compaction",
    "EncryptionKeyMissing",
    "InvalidLimit",
    "MessageRefused",
    "RedisUnreachable",
    "ResumeRefused",
    "Run",
    "RunExists",
    "RunNotFound",
    "RunTimeout",
    "SchemaTooNew",
    "Shards",
    "StoreError",
    "Subagent",
    "Tool",
    "ToolCall",
    "ToolInputError",
    "UnreadableRecord",
    "approve",
    "cancel_run",
    "connect",
    "current_call",
    "enqueue_run",
    "fork_run",
    "get_run",
    "list_runs",
    "resume",
    "send_message",
    "set_price",
    "tool",
    "wait_for_run",
    "watch",
]
