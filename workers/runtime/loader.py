"""Loading the agent a run names (``module:attribute``) in a worker."""

from __future__ import annotations

import importlib
import sys

from agentpool.agent import Agent, check_agent_path
from agentpool.store.errors import AgentPoolError


class AgentNotFound(AgentPoolError):
    pass


def load_agent(path: str) -> Agent:
    """Import ``module:attribute`` with the current directory on the path, as ``rq worker`` does."""
    check_agent_path(path)
    module_name, _, attr = path.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AgentNotFound(f"cannot import module {module_name!r} for agent {path!r}: {exc}") from exc
    agent = getattr(module, attr, None)
    if not isinstance(agent, Agent):
        raise AgentNotFound(f"{path!r} is not an agentpool Agent (found {type(agent).__name__})")
    return agent
