"""Agents whose tools misbehave the ways real tools do: text that cannot be encoded, huge errors,
hangs, subprocesses that outlive them, hung verify hooks, effects that land after a worker froze.
Every real effect is counted in the file named by AGENTPOOL_TEST_EFFECTS (``pool_agents.record``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from agentpool import Agent, AgentPoolError, current_call, tool

from pool_agents import effects, record

LONE_SURROGATE = json.loads('"\\ud83d"')  # half an emoji, as a JSON API cut mid-character sends it


@tool(effect="read")
def fetch_title(url: str) -> str:
    """Fetch a page's title."""
    record("fetch_title", url=url)
    return "Title " + LONE_SURROGATE


@tool(effect="read")
def parse_feed(url: str) -> str:
    """Parse a feed; fails on this one, quoting the bad bytes."""
    record("parse_feed", url=url)
    raise ValueError(f"bad entry {LONE_SURROGATE!s} at byte 12")


@tool(effect="read")
def dump_state(item: str) -> str:
    """Fails with an enormous message."""
    record("dump_state", item=item)
    raise RuntimeError("state: " + "x" * 1_000_000)


@tool(effect="read", timeout=1.0)
def crunch(n: int) -> str:
    """Computes for ever: outlives its timeout, spinning."""
    record("crunch", n=n)
    while True:
        n = (n * 31 + 7) % 1_000_003


@tool(effect="unsafe", timeout=1.0)
def wire_money(amount_cents: int, *, idempotency_key: str) -> str:
    """Send a wire transfer."""
    record("wire_money", amount=amount_cents)
    return f"wired {amount_cents}"


@wire_money.verify
def _wire_went_out(amount_cents: int, *, idempotency_key: str) -> str | bool | None:
    time.sleep(60)  # the bank's status API hangs
    return False


STUBBORN_CHILD = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
beats = os.path.join(sys.argv[1], f"beats-{os.getpid()}")
while True:
    with open(beats + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(beats + ".tmp", beats)
    time.sleep(0.01)
"""


def beats_file(pid: int) -> Path:
    return Path(os.environ["AGENTPOOL_TEST_EFFECTS"]).with_name(f"beats-{pid}")


@tool(effect="read")
def run_report(name: str) -> str:
    """Run a report in a subprocess that ignores SIGTERM (it writes the time to ``beats-<pid>`` every
    10 ms, so its last beat says when it died); the first attempt waits on it for a minute."""
    call = current_call()
    if call is not None and call.attempt > 1:
        record("run_report", attempt=call.attempt)
        return "report ready"
    child = subprocess.Popen([sys.executable, "-c", STUBBORN_CHILD, str(beats_file(0).parent)])  # our group
    record("run_report", attempt=call.attempt if call else 0, child=child.pid)
    time.sleep(60)
    return "too late"


def _charge(tool_name: str, amount_cents: int, *, check_ownership: bool) -> str:
    record(f"{tool_name}_started", amount=amount_cents)
    time.sleep(2.0)  # the payment API is slow; a worker frozen here wakes up right before the effect
    call = current_call()
    if check_ownership and call is not None:
        try:
            call.ensure_owned()
        except AgentPoolError as exc:  # CallNotOwned
            record(f"{tool_name}_refused", reason=str(exc))
            raise
    record(tool_name, amount=amount_cents)
    return f"charged {amount_cents} cents"


def _charged(tool_name: str, key: str, amount_cents: int) -> str | bool:
    done = [e for e in effects(os.environ["AGENTPOOL_TEST_EFFECTS"]) if e["tool"] == tool_name and e["key"] == key]
    return f"charged {amount_cents} cents (confirmed by the processor)" if done else False


@tool(effect="unsafe")
def slow_charge(amount_cents: int, *, idempotency_key: str) -> str:
    """Charge a card through a slow payment API."""
    return _charge("slow_charge", amount_cents, check_ownership=False)


@slow_charge.verify
def _slow_charge_went_through(amount_cents: int, *, idempotency_key: str) -> str | bool:
    return _charged("slow_charge", idempotency_key, amount_cents)


@tool(effect="unsafe")
def careful_charge(amount_cents: int, *, idempotency_key: str) -> str:
    """Charge a card, checking just before the charge that this worker still owns the call."""
    return _charge("careful_charge", amount_cents, check_ownership=True)


@careful_charge.verify
def _careful_charge_went_through(amount_cents: int, *, idempotency_key: str) -> str | bool:
    return _charged("careful_charge", idempotency_key, amount_cents)


MISBEHAVING = [fetch_title, parse_feed, dump_state, crunch, wire_money, run_report]
misbehaving = Agent(model="claude-sonnet-5-5", system="Cope.", tools=MISBEHAVING, max_turns=6, max_result_chars=1000)

# A frozen worker's charge: the tools' timeout decides how long a takeover waits for the first attempt.
payments = Agent(model="claude-sonnet-5-5", system="Pay.", tools=[slow_charge, careful_charge], tool_timeout=4.0)
slow_payments = Agent(model="claude-sonnet-5-5", system="Pay.", tools=[slow_charge, careful_charge], tool_timeout=8.0)
