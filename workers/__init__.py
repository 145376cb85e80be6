"""agentpool: durable Claude agent runs on a pool of RQ workers over Redis.

The public API. Below it, in layers that import only downwards (checked by the tests, see
``pyproject.toml``): ``agentpool.ops`` (the CLI, dashboard, metrics, demo, bench), ``agentpool.worker``
(the processes that run turns) beside ``agentpool.client`` (what apps call) and ``agentpool.watching``
(following a run live), ``agentpool.runtime`` (one
turn), the definitions apps write (``agent``, ``tools``, ``context``, ``pricing``) and ``agentpool.store``
(Redis). ``agentpool.testing`` is a kit for tests.
"""

from agentpool.agent import Agent, Compaction
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
from agentpool.store.crypto import EncryptionKeyMissing
from agentpool.store.errors import (
    AgentPoolError,
    MessageRefused,
    RunExists,
    RunNotFound,
    SchemaTooNew,
    StoreError,
    UnreadableRecord,
)
from agentpool.tools import Tool, ToolInputError, tool
from agentpool.watching import watch

__all__ = [
    "Agent",
    "AgentPoolError",
    "ApprovalError",
    "CallNotOwned",
    "Compaction",
    "EncryptionKeyMissing",
    "InvalidLimit",
    "MessageRefused",
    "ResumeRefused",
    "Run",
    "RunExists",
    "RunNotFound",
    "RunTimeout",
    "SchemaTooNew",
    "StoreError",
    "Tool",
    "ToolCall",
    "ToolInputError",
    "UnreadableRecord",
    "approve",
    "cancel_run",
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
