"""agentpool: durable Claude agent runs on a pool of RQ workers over Redis."""

from workers.agent import Agent
from workers.context import ToolCall, current_call
from workers.api import Run, RunTimeout, cancel_run, enqueue_run, get_run, list_runs, wait_for_run
from workers.tools import tool

__all__ = [
    "Agent", "Run", "RunTimeout", "ToolCall", "cancel_run", "current_call", "enqueue_run", "get_run", "list_runs", "tool", "wait_for_run"]
