"""Agents for long runs (tests/test_long_runs.py): tools that return pages big enough to fill a small
context window in a few turns, with and without compaction. Workers import them from this module."""

from __future__ import annotations

import os

from agentpool import Agent, tool
from agentpool.agent import Compaction

from pool_agents import record, send_email


@tool(effect="read")
def read_page(page: int, size: int = 4000) -> str:
    """Read one page of the archive.

    Args:
        page: Which page.
        size: How many characters of it.
    """
    record("read_page", page=page)
    line = f"page {page}: the archive says item {page} shipped on time. "
    return (line * (size // len(line) + 1))[:size]


TOOLS = [read_page, send_email]

# agentpool's own compaction (Haiku 4.5 has no server-side compaction): a summary once a request
# would pass 6,000 tokens.
summarizing = Agent(
    model="claude-haiku-4-5",
    system="You read the archive page by page.",
    tools=TOOLS,
    max_turns=80,
    compaction=Compaction(trigger=6_000, summary_max_tokens=1_000),
)

# The API's compaction: the compact_20260112 edit, at its lowest trigger.
compacting = Agent(
    model="claude-sonnet-5-5",
    system="You read the archive page by page.",
    tools=TOOLS,
    max_turns=80,
    compaction=Compaction(trigger=50_000),
)
pausing = Agent(
    model="claude-sonnet-5-5",
    system="You read the archive page by page.",
    tools=TOOLS,
    max_turns=80,
    compaction=Compaction(trigger=50_000, pause_after_compaction=True),
)

# Compaction off, unless the workers run with LONG_RUNS_COMPACTION=1: "turn compaction on and resume".
switchable = Agent(
    model="claude-haiku-4-5",
    system="You read the archive page by page.",
    tools=TOOLS,
    max_turns=80,
    compaction=Compaction(trigger=6_000, summary_max_tokens=1_000)
    if os.environ.get("LONG_RUNS_COMPACTION") == "1"
    else None,
)

# The API's tool-result clearing, passed through beside its compaction: results beyond the last one are
# cleared once three tool uses are in the request.
clearing = Agent(
    model="claude-sonnet-5-5",
    system="You read the archive page by page.",
    tools=TOOLS,
    max_turns=80,
    compaction=Compaction(
        trigger=50_000,
        clear_tool_uses={"trigger": {"type": "tool_uses", "value": 3}, "keep": {"type": "tool_uses", "value": 1}},
    ),
)
