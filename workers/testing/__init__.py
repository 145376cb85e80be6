"""A testing kit, for this project's tests and for apps testing their own agents without an API key:

- ``LocalPool`` / ``local_pool(...)``: a throwaway redis-server, the scripted Messages API and real
  worker processes running your agents (``pool.run("myapp.agents:support", "task")``), killed for
  real where a test says: the worker running a run's turn (``kill_turn``), or whatever process
  reaches a named point of a run (``run(..., kill_at="in_tool", kill_tool="charge")``);
- ``ScriptedModel``: a strict stand-in for the Messages API answering from scripts (steps, branches on
  the last tool results, or Python functions of a ``ScriptRequest``);
- ``call_tool`` / ``tool_result`` / ``tool_context``: one tool called as a worker calls it;
- ``assert_valid_conversation``: what the API demands of tool_use and tool_result pairs;
- ``settled_stats``: the pool-wide counters behind ``/metrics`` once the workers have flushed them;
- ``agentpool.testing.pytest_plugin``: fixtures, opted into with
  ``pytest_plugins = ["agentpool.testing.pytest_plugin"]`` in a conftest.py.

Nothing in agentpool imports it outside the tests, the demo and the bench.
"""

from agentpool.testing.conversation import assert_valid_conversation
from agentpool.testing.pool import Kill, LocalPool, NothingKilled, local_pool
from agentpool.testing.scripted_model import ScriptedModel, ScriptRequest, ToolResult
from agentpool.testing.stats import settled_stats
from agentpool.testing.tools import call_tool, tool_context, tool_result

__all__ = [
    "Kill",
    "LocalPool",
    "NothingKilled",
    "ScriptRequest",
    "ScriptedModel",
    "ToolResult",
    "assert_valid_conversation",
    "call_tool",
    "local_pool",
    "settled_stats",
    "tool_context",
    "tool_result",
]
