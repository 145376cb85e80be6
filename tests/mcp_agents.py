"""Agents whose tools live in MCP servers (tests/mcp_servers.py): a read-only docs server over stdio
and a CRM with destructive tools, over stdio or streamable HTTP (MCP_CRM_URL, a server the test runs);
a server whose one tool has a schema jsonschema cannot apply."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from agentpool import Agent

from pool_agents import read_notes

HERE = str(Path(__file__).parent / "mcp_servers.py")
ENV = {k: os.environ[k] for k in ("MCP_TEST_EFFECTS", "MCP_TEST_HIDDEN", "MCP_TEST_GATES") if k in os.environ}


def stdio(kind: str) -> dict:
    return {"type": "stdio", "command": sys.executable, "args": [HERE, kind, "stdio"], "env": ENV}


def crm() -> dict:
    url = os.environ.get("MCP_CRM_URL")
    return {"type": "http", "url": url, "headers": {"Authorization": "Bearer crm-test"}} if url else stdio("crm")


support = Agent(
    model="claude-sonnet-5-5",
    system="You help with customer accounts.",
    tools=[read_notes],
    mcp_servers={"docs": stdio("docs"), "crm": crm()},
    mcp_effects={"mcp__crm__set_tier": "unsafe"},  # annotated idempotent; the agent knows better
    tool_timeout=5.0,
)

gated = Agent(
    model="claude-sonnet-5-5",
    mcp_servers={"crm": crm()},
    mcp_requires_approval={"mcp__crm__delete_customer"},
)

impatient = Agent(
    model="claude-sonnet-5-5",
    mcp_servers={"docs": stdio("docs")},
    tool_timeout=1.0,
)

broken_schema = Agent(
    model="claude-sonnet-5-5",
    mcp_servers={"broken": stdio("broken")},
)
