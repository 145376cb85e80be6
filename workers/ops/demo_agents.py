"""The agent the demo runs. Its tools write to an outbox file (AGENTPOOL_DEMO_OUTBOX) so the demo
can count, from outside the pool, how many times each side effect really happened."""

from __future__ import annotations

import json
import os
import time

from agentpool.agent import Agent
from agentpool.context import current_call
from agentpool.tools import tool


def _record(kind: str, **fields: object) -> None:
    path = os.environ.get("AGENTPOOL_DEMO_OUTBOX")
    if not path:
        return
    call = current_call()
    line = {"kind": kind, "run": call.run_id if call else None, "key": call.idempotency_key if call else None, **fields}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@tool(effect="read")
def read_notes(team: str) -> str:
    """Read this week's meeting notes of a team.

    Args:
        team: The team whose notes to read.
    """
    time.sleep(0.4)  # a slow file system: time for the demo's crash to land mid-tool
    _record("read", team=team)
    return f"{team} notes: release on Friday; the changelog is late; Ana owns it."


@tool(effect="idempotent")
def create_ticket(title: str, body: str, *, idempotency_key: str) -> str:
    """Open a ticket in the tracker.

    Args:
        title: One line summary.
        body: What needs doing.
    """
    time.sleep(0.3)
    _record("ticket", title=title)
    return f"ticket {idempotency_key[-6:].upper()} open: {title}"


@tool(effect="unsafe")
def send_email(to: str, subject: str, body: str) -> str:
    """Send an email. Never sent twice: after a crash with no record of the outcome, you are told.

    Args:
        to: Recipient address.
        subject: Subject line.
        body: Plain text body.
    """
    time.sleep(0.3)
    _record("email", to=to, subject=subject)
    return f"sent to {to}"


secretary = Agent(
    model=os.environ.get("AGENTPOOL_DEMO_MODEL", "claude-haiku-5-5"),
    system=(
        "You are a team secretary. Read the team's notes, open one ticket for the most urgent action "
        "item, email a two-line summary to the team, then answer with one sentence."
    ),
    tools=[read_notes, create_ticket, send_email],
    # The tools answer in under a second. A whole worker killed mid-call leaves a worker taking over to
    # wait out the call's timeout (plus a margin) before repeating it: keep that short, as for real tools.
    tool_timeout=5.0,
    max_turns=10,
    max_tokens=1024,
)


def demo_script(team_email: str = "team@example.com") -> list[dict]:
    """What the scripted model answers for each demo run: read, then ticket + email at once, then done."""
    return [
        {
            "delay": 0.3,
            "text": "Reading the notes first.",
            "tool_calls": [{"name": "read_notes", "input": {"team": "the team"}}],
        },
        {
            "delay": 0.5,
            "text": "Opening a ticket and telling the team.",
            "tool_calls": [
                {
                    "name": "create_ticket",
                    "input": {"title": "Changelog is late", "body": "Ana to finish it before Friday."},
                },
                {
                    "name": "send_email",
                    "input": {
                        "to": team_email,
                        "subject": "This week",
                        "body": "Release Friday. Changelog ticket open.",
                    },
                },
            ],
        },
        {
            "delay": 0.3,
            "text": "Summarized: release Friday, a ticket is open for the late changelog, and the team is told.",
        },
    ]
