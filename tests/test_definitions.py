"""Mistakes in an agent's definition are refused where they are made (at ``@tool`` or ``Agent(...)``), with
a message that says what to do, instead of surfacing in a worker or, worse, in a crash recovery."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from agentpool import Agent, InvalidLimit, enqueue_run, tool, wait_for_run

from conftest import script_task


@tool(effect="unsafe")
def send_email(to: str, subject: str, body: str = "") -> str:
    """Send an email."""
    return "sent"


@tool(effect="read")
def read_notes(topic: str) -> str:
    """Read notes."""
    return topic


class Connection:
    """Something a tool might wish it were given, but the model can only send JSON."""


def test_an_async_tool_runs_to_completion_in_a_worker_under_its_timeout(r, pool, model):
    model.set_scripts(
        {
            "async": [
                {"tool_calls": [{"name": "async_lookup", "input": {"item": "kettle"}}]},
                {"tool_calls": [{"name": "async_hang", "input": {"item": "teapot"}}]},
                {"text": "done"},
            ]
        }
    )
    pool.start(1)
    run = wait_for_run(
        enqueue_run("pool_agents:asynchronous", script_task("async"), connection=r), timeout=60, connection=r
    )

    assert run.status == "completed", run.error
    results = [b for m in run.messages if m["role"] == "user" for b in m["content"] if isinstance(b, dict)]
    assert results[0]["content"] == "kettle: found by an async tool" and not results[0].get("is_error")
    assert results[1]["is_error"] and "timed out after 0.5 s" in results[1]["content"]
    ran = {e["tool"]: e for e in pool.effects()}
    assert ran["async_lookup"]["in_call"] is True, "current_call() is set inside the coroutine"


def test_an_async_tool_is_still_a_coroutine_function_for_the_apps_own_code():
    @tool(effect="read")
    async def lookup(item: str) -> str:
        """Look up."""
        return item

    coroutine = lookup("x")
    assert hasattr(coroutine, "__await__")
    coroutine.close()
    assert lookup.fn(item="y") == "y", "what the worker calls runs it to completion"


def test_generators_are_refused_at_tool():
    def numbers(n: int):
        yield n

    async def stream(n: int):
        yield n

    for fn in (numbers, stream):
        with pytest.raises(TypeError, match="generator function"):
            tool(effect="read")(fn)


def test_a_verify_hook_that_cannot_take_the_tools_arguments_is_refused_at_registration():
    with pytest.raises(TypeError) as refused:

        @send_email.verify
        def _was_sent(to: str, subject: str) -> bool:  # no body, no idempotency_key
            return False

    message = str(refused.value)
    assert "send_email" in message and "_was_sent" in message
    assert "def _was_sent(to, subject, body, *, idempotency_key)" in message
    assert send_email.verify_fn is None, "the broken hook was not registered"

    def sent(to: str) -> str:
        return "sent"

    with pytest.raises(TypeError, match="idempotency_key"):
        tool(effect="unsafe", verify=lambda to: None)(sent)

    @send_email.verify
    def _fine(to, subject, body, *, idempotency_key):
        return None

    @send_email.verify
    def _also_fine(**kwargs):
        return None

    assert send_email.verify_fn is _also_fine


def test_a_verify_hook_on_a_read_or_idempotent_tool_is_refused():
    with pytest.raises(TypeError, match="verify hook is for unsafe tools; a read tool"):
        read_notes.verify(lambda topic, *, idempotency_key: None)

    def ticket(title: str, *, idempotency_key: str) -> str:
        return title

    with pytest.raises(TypeError, match="an idempotent tool is simply run again with the same idempotency_key"):
        tool(effect="idempotent", verify=lambda title, *, idempotency_key: None)(ticket)


def test_an_async_verify_hook_is_run_to_completion():
    @tool(effect="unsafe")
    def charge(amount: int) -> str:
        return "charged"

    @charge.verify
    async def _charged(amount: int, *, idempotency_key: str) -> str | bool:
        return f"charged {amount} ({idempotency_key})"

    assert charge.verify_fn(amount=5, idempotency_key="k") == "charged 5 (k)"


def test_a_plain_function_in_agent_tools_says_decorate_it_with_tool():
    def lookup(item: str) -> str:
        return item

    with pytest.raises(TypeError, match=r"lookup is not a tool; decorate it with @tool\(effect=...\)"):
        Agent(model="claude-sonnet-5-5", tools=[read_notes, lookup])
    with pytest.raises(TypeError, match="takes a list of @tool functions"):
        Agent(model="claude-sonnet-5-5", tools=read_notes)  # type: ignore[arg-type]


@pytest.mark.parametrize("hint", [Connection, Callable[[int], int]], ids=["class", "callable"])
def test_a_parameter_type_pydantic_cannot_describe_is_named_at_tool(hint):
    def open_ticket(title: str, conn: Any) -> str:
        return title

    open_ticket.__annotations__["conn"] = hint
    with pytest.raises(TypeError) as refused:
        tool(effect="unsafe")(open_ticket)
    message = str(refused.value)
    assert "tool open_ticket: parameter 'conn'" in message and "JSON Schema" in message
    assert "arbitrary_types_allowed" not in message, "no advice to turn validation off"


def test_the_common_decorator_slips_are_explained():
    with pytest.raises(TypeError, match=r"write @tool\(effect='read'\)"):
        tool("read")
    with pytest.raises(TypeError, match="already a tool"):
        tool(effect="read")(read_notes)


NOT_LIMITS = [math.nan, math.inf, -math.inf, 0, -1, True, "10", None]


@pytest.mark.parametrize("value", NOT_LIMITS, ids=repr)
@pytest.mark.parametrize(
    "name", ["max_turns", "max_tokens", "max_total_tokens", "max_cost_usd", "tool_timeout", "max_result_chars"]
)
def test_every_agent_limit_is_a_finite_positive_number_or_a_clear_error(name, value):
    if value is None and name in ("max_total_tokens", "max_cost_usd"):
        Agent(model="claude-sonnet-5-5", **{name: value})  # None: no limit, as documented
        return
    with pytest.raises((InvalidLimit, TypeError)) as refused:
        Agent(model="claude-sonnet-5-5", **{name: value})
    assert name in str(refused.value)


def test_whole_limits_refuse_fractions_and_accept_whole_floats():
    with pytest.raises(InvalidLimit, match="max_turns must be a whole number"):
        Agent(model="claude-sonnet-5-5", max_turns=2.5)
    assert Agent(model="claude-sonnet-5-5", max_turns=10.0).max_turns == 10  # JSON may send 10.0


@pytest.mark.parametrize("option", ["timeout", "approval_timeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0, True], ids=repr)
def test_tool_timeouts_are_finite_positive_numbers(option, value):
    with pytest.raises(InvalidLimit, match=option):
        tool(effect="read", **{option: value})(lambda item: item)


def test_a_nan_limit_already_in_a_record_does_not_switch_a_budget_off():
    from agentpool.runtime.limits import Limits

    agent = Agent(model="claude-sonnet-5-5", max_turns=5, max_cost_usd=1.0)
    # As an older version could write them: a NaN budget, and NaN added by resume.
    held = Limits.of(agent, {"max_cost_usd": math.nan, "extra_usd": math.nan, "extra_turns": math.inf})
    assert (held.max_turns, held.max_cost_usd) == (5, 1.0), "the agent's limits hold"
    assert Limits.of(agent, {"max_cost_usd": 2.0, "extra_usd": 0.5}).max_cost_usd == 2.5


@tool(effect="unsafe")
def refund(amount: float, count: int, confirm: bool, note: str = "") -> str:
    """Refund."""
    return "refunded"


@pytest.mark.parametrize(
    "given, why",
    [
        ({"amount": "nan", "count": 1, "confirm": True}, "amount"),  # lax mode: float('nan') passes `amount > cap`
        ({"amount": 5, "count": "7", "confirm": True}, "count"),
        ({"amount": 5, "count": 1, "confirm": "yes"}, "confirm"),
        ({"amount": 5, "count": 1, "confirm": 1}, "confirm"),
        ({"amount": math.inf, "count": 1, "confirm": True}, "not JSON"),
        ({"amount": 5, "count": 1, "confirm": True, "note": 3}, "note"),
    ],
)
def test_tool_input_is_checked_as_the_json_schema_says_not_coerced(given, why):
    from agentpool import ToolInputError

    with pytest.raises(ToolInputError, match=f"invalid input for refund: .*{why}"):
        refund.validate(given)
    assert refund.validate({"amount": 5, "count": 1, "confirm": True}) == {
        "amount": 5.0,
        "count": 1,
        "confirm": True,
        "note": "",
    }
