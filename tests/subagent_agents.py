"""Agents that delegate to sub-agents (child runs), for the tests in real worker processes."""

from __future__ import annotations

from agentpool import Agent, Subagent, tool

from pool_agents import read_notes, record, send_email

MODEL = "claude-sonnet-5-5"


@tool(effect="unsafe")
def file_report(title: str) -> str:
    """File a report (an effect that must not happen twice)."""
    record("file_report", title=title)
    return f"report {title!r} filed"


researcher = Agent(model=MODEL, system="Research one topic.", tools=[read_notes, file_report], max_turns=6)
orchestrator = Agent(
    model=MODEL,
    system="Split the task and delegate.",
    tools=[send_email],
    subagents={"researcher": Subagent("subagent_agents:researcher", description="Researches one topic.")},
    max_turns=6,
)
# Two levels: the lead delegates to a manager, which delegates to researchers.
manager = Agent(model=MODEL, system="Manage.", subagents={"researcher": "subagent_agents:researcher"}, max_turns=6)
lead = Agent(model=MODEL, system="Lead.", subagents={"manager": "subagent_agents:manager"}, max_turns=6)
# Delegates to itself: the depth limit must stop it.
recursive = Agent(model=MODEL, system="Delegate.", subagents={"delegate": "subagent_agents:recursive"}, max_turns=4)
# A small result limit: a long child answer is cut in the parent's tool_result.
terse = Agent(
    model=MODEL,
    system="Delegate.",
    subagents={"researcher": "subagent_agents:researcher"},
    max_result_chars=200,
    max_turns=4,
)
