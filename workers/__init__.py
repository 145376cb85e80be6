"""agentpool: durable Claude agent runs on a pool of RQ workers over Redis.

The public API. Below it, in layers that import only downwards (checked by the tests, see
``pyproject.toml``): ``agentpool.ops`` (the CLI, dashboard, metrics, demo, bench), ``agentpool.worker``
(the processes that run turns) beside ``agentpool.client`` (what apps call), ``agentpool.runtime`` (one
turn), the definitions apps write (``agent``, ``tools``, ``context``, ``pricing``) and ``agentpool.store``
(Redis). ``agentpool.testing`` is a kit for tests.
"""

from agentpool.agent import Agent
from agentpool.client import Run, RunTimeout, approve, cancel_run, enqueue_run, get_run, list_runs, resume, wait_for_run
from agentpool.context import ToolCall, current_call
from agentpool.runtime.approvals import ApprovalError
from agentpool.store.errors import AgentPoolError, RunExists, RunNotFound
from agentpool.tools import tool

__all__ = [
    "Agent",
    "AgentPoolError",
    "ApprovalError",
    "Run",
    "RunExists",
    "RunNotFound",
    "RunTimeout",
    "ToolCall",
    "approve",
    "cancel_run",
    "current_call",
    "enqueue_run",
    "get_run",
    "list_runs",
    "resume",
    "tool",
    "wait_for_run",
]
