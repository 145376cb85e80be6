"""Agents that delegate to sub-agents (child runs), for the tests in real worker processes."""

from __future__ import annotations

from agentpool import Agent, Subagent, tool

from pool_agents import deploy, read_notes, record, send_email

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
# Stops on its own max_turns after one turn: its parent gets an error result and goes on.
brief = Agent(model=MODEL, system="Research one topic.", tools=[read_notes], max_turns=1)
# Delegates to the brief researcher; stops on its own max_turns; deploy asks a person first.
patient = Agent(
    model=MODEL,
    system="Delegate, then check and deploy.",
    tools=[read_notes, deploy],
    subagents={"researcher": "subagent_agents:brief"},
    max_turns=2,
)
# At most two sub-agents started by one response.
narrow = Agent(model=MODEL, system="Delegate.", subagents={"researcher": "subagent_agents:researcher"}, max_fanout=2)
# One sub-agent on the parent's queue and key, one on a queue and key of its own.
router = Agent(
    model=MODEL,
    system="Delegate.",
    subagents={
        "researcher": "subagent_agents:researcher",
        "escalate": Subagent("subagent_agents:researcher", queue="urgent", concurrency_key="vip", max_concurrency=3),
    },
    max_turns=4,
)
# Delegates to the patient agent, whose deploy asks a person first (tests/test_usability.py: wait_for_run).
overseer = Agent(model=MODEL, system="Delegate.", subagents={"deployer": "subagent_agents:patient"}, max_turns=4)
