"""agentpool: durable Claude agent runs on a pool of RQ workers over Redis."""

from workers.agent import Agent
from workers.api import Run, RunTimeout, cancel_run, enqueue_run, get_run, list_runs, resume, wait_for_run
from workers.approvals import ApprovalError, approve
from workers.context import ToolCall, current_call
from workers.tools import tool

__all__ = [
    "Agent",
    "ApprovalError",
    "Run",
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
