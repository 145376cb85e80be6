"""agentpool: durable Claude agent runs on a pool of RQ workers over Redis."""

from workers.agent import Agent
from workers.api import Run, RunTimeout, cancel_run, enqueue_run, get_run, list_runs, wait_for_run
from workers.tools import tool

__all__ = ["Agent", "Run", "RunTimeout", "cancel_run", "enqueue_run", "get_run", "list_runs", "tool", "wait_for_run"]
