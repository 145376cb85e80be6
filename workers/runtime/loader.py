"""Loading the agent a run names (``module:attribute``) in a worker.

One rule for both worker kinds: an agent's module is imported once per worker process, with the
worker's working directory on the path (as ``rq worker`` does), and stays imported. The threaded
worker imports it in the thread of the first turn that needs it; the forking worker imports it in the
worker process before it forks the work horse (``agentpool.worker.forking``), so every horse inherits
it instead of importing it afresh. New agent code therefore reaches a worker when the worker restarts
(a rolling restart of the pool), never in the middle of its life; until then a pool may hold workers
with older code, which is why a worker that cannot load an agent hands the turn back for another
(``agentpool.runtime.turn``) instead of failing the run. A module that failed to import is not kept:
the next turn tries again.
"""

from __future__ import annotations

import importlib
import sys

from agentpool.agent import Agent, check_agent_path
from agentpool.store.errors import AgentPoolError


class AgentNotFound(AgentPoolError):
    """This process cannot load the run's agent: its module does not import here, lacks the
    attribute, or the attribute is not an ``Agent``. Possibly only this worker's code is old."""


def load_agent(path: str, *, add_cwd: bool = True, connect_mcp: bool = True) -> Agent:
    """Import ``module:attribute`` with the current directory on the path, as ``rq worker`` does
    (``add_cwd=False``: with the process's own path, for an app checking an agent at enqueue).
    ``connect_mcp=False``: the agent's MCP servers are not connected to (nor a stdio one started) to
    list their tools: an app checking the agent it enqueues runs none of them."""
    check_agent_path(path)
    module_name, _, attr = path.partition(":")
    if add_cwd and "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AgentNotFound(f"cannot import module {module_name!r} for agent {path!r}: {exc}") from exc
    try:
        agent = getattr(module, attr)
    except AttributeError:
        raise AgentNotFound(f"module {module_name!r} has no attribute {attr!r} (agent {path!r})") from None
    if not isinstance(agent, Agent):
        raise AgentNotFound(f"{path!r} is not an agentpool Agent (found {type(agent).__name__})")
    if agent.mcp_configs and connect_mcp:  # its servers' tools, as listed now (connecting once per worker process)
        from agentpool.runtime.mcp_hub import attach

        attach(agent)
    return agent
