"""Agents the tests run in real worker processes. Every real tool execution is appended to the file
named by AGENTPOOL_TEST_EFFECTS: a count kept outside the system under test."""

from __future__ import annotations

import asyncio
import json
import os
import time

from agentpool import Agent, current_call, tool


def record(tool_name: str, **info: object) -> None:
    call = current_call()
    line = {"tool": tool_name, "pid": os.getpid(), **info}
    if call:
        line.update(run=call.run_id, tool_use_id=call.tool_use_id, key=call.idempotency_key, attempt=call.attempt)
    path = os.environ.get("AGENTPOOL_TEST_EFFECTS")
    if path:
        with open(path, "a") as f:  # O_APPEND: one short line is written whole
            f.write(json.dumps(line) + "\n")


def effects(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@tool(effect="read")
def read_notes(topic: str) -> str:
    """Read the meeting notes about a topic.

    Args:
        topic: What the notes are about.
    """
    record("read_notes", topic=topic)
    return f"Notes on {topic}: ship the release on Friday; Ana owns the changelog."


@tool(effect="idempotent")
def create_ticket(title: str, body: str, *, idempotency_key: str) -> str:
    """Open a ticket in the tracker."""
    record("create_ticket", title=title)
    return f"ticket {idempotency_key[-6:]} created: {title}"


@tool(effect="unsafe")
def send_email(to: str, subject: str, body: str) -> str:
    """Send an email."""
    record("send_email", to=to, subject=subject)
    return f"email to {to} sent"


@tool(effect="unsafe")
def charge_card(amount_cents: int, *, idempotency_key: str) -> str:
    """Charge the customer's card (the processor can be asked whether a charge went through)."""
    record("charge_card", amount=amount_cents)
    return f"charged {amount_cents} cents"


@charge_card.verify
def _charge_went_through(amount_cents: int, *, idempotency_key: str) -> str | bool | None:
    path = os.environ.get("AGENTPOOL_TEST_EFFECTS", "")
    done = [e for e in effects(path) if e["tool"] == "charge_card" and e.get("key") == idempotency_key]
    return f"charged {amount_cents} cents (confirmed by the processor)" if done else False


@tool(effect="read")
def slow_read(seconds: float) -> str:
    """Read something slowly."""
    record("slow_read", seconds=seconds)
    time.sleep(seconds)
    return f"waited {seconds}s"


@tool(effect="read")
def timed_work(seconds: float) -> str:
    """Work for a while; when it ran is recorded (to see how many ran at once)."""
    started = time.time()
    time.sleep(seconds)
    record("timed_work", started=started, ended=time.time())
    return "worked"


@tool(effect="read")
def flaky_lookup(item: str) -> str:
    """Look something up; raises for item 'boom'."""
    record("flaky_lookup", item=item)
    if item == "boom":
        raise RuntimeError("the lookup service is down")
    return f"{item}: in stock"


@tool(effect="read", timeout=0.5)
def hanging_lookup(item: str) -> str:
    """A lookup that never answers in time."""
    record("hanging_lookup", item=item)
    time.sleep(30)
    return "too late"


@tool(effect="read")
def odd_result(item: str) -> object:
    """Returns something that cannot be sent to the model."""
    return object()


ALL_TOOLS = [
    read_notes,
    create_ticket,
    send_email,
    charge_card,
    slow_read,
    timed_work,
    flaky_lookup,
    hanging_lookup,
    odd_result,
]

support = Agent(
    model="claude-sonnet-5-5",
    system="You are a careful support engineer.",
    tools=ALL_TOOLS,
    max_turns=12,
    max_tokens=1024,
)

short = Agent(model="claude-sonnet-5-5", system="Be brief.", tools=ALL_TOOLS, max_turns=2)


@tool(effect="unsafe", requires_approval=True)
def deploy(version: str) -> str:
    """Deploy a version to production (a person must approve)."""
    record("deploy", version=version)
    return f"deployed {version}"


@tool(effect="unsafe", requires_approval=True, approval_timeout=1.0)
def wipe_cache(region: str) -> str:
    """Wipe a CDN cache region (denied automatically if nobody answers within a second)."""
    record("wipe_cache", region=region)
    return f"wiped {region}"


guarded = Agent(
    model="claude-sonnet-5-5", system="Ask before deploying.", tools=[read_notes, deploy, wipe_cache], max_turns=10
)
budgeted = Agent(model="claude-sonnet-5-5", system="Be brief.", tools=[read_notes], max_turns=20, max_total_tokens=None)


@tool(effect="read")
async def async_lookup(item: str) -> str:
    """Look something up with an async client."""
    await asyncio.sleep(0.01)
    record("async_lookup", item=item, in_call=current_call() is not None)
    return f"{item}: found by an async tool"


@tool(effect="read", timeout=0.5)
async def async_hang(item: str) -> str:
    """An async lookup that never answers in time."""
    record("async_hang", item=item)
    await asyncio.sleep(30)
    return "too late"


asynchronous = Agent(model="claude-sonnet-5-5", system="Be brief.", tools=[async_lookup, async_hang], max_turns=5)


@tool(effect="unsafe", requires_approval=True)
def issue_credit(order: str, cents: int) -> str:
    """Credit a customer's account for an order (a person approves each credit)."""
    record("issue_credit", order=order, cents=cents)
    return f"credited {cents} cents for {order}"


@tool(effect="read")
def order_status(order: str) -> str:
    """Look up where an order is."""
    return f"order {order}: shipped on Monday"


refunds = Agent(
    model="claude-sonnet-5-5", system="You handle refunds.", tools=[issue_credit, order_status], max_turns=6
)
