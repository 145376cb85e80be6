"""The testing kit as an app author uses it (docs/testing.md): a local pool in a few lines,
scripts that react to what the tools answered (a denied approval above all), script functions, a
pytest fixture, and one tool called as a worker calls it."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
import threading
import time

import anthropic
import pytest
from redis import Redis
from redis.exceptions import RedisError
from rq import Worker

from agentpool import current_call, tool
from agentpool.runtime.reconcile import idempotency_key
from agentpool.store.events import read as read_events
from agentpool.testing import (
    LocalPool,
    NothingKilled,
    ScriptedModel,
    ScriptRequest,
    assert_valid_conversation,
    call_tool,
    local_pool,
    tool_context,
    tool_result,
)
from agentpool.tools import ToolInputError

from conftest import TESTS

CREDIT = [
    {"tool_calls": [{"name": "issue_credit", "input": {"order": "A-17", "cents": 500}}]},
    {
        "branches": [
            {"when": {"tool": "issue_credit", "is_error": True}, "text": "I could not issue the credit."},
            {"when": {"tool": "issue_credit", "result_matches": r"credited \d+ cents"}, "text": "Credit issued."},
        ]
    },
]


@pytest.fixture
def shared_pool(r, redis_server, model):
    """A LocalPool on the suite's own redis-server and scripted model (cwd: the tests, for pool_agents)."""
    with LocalPool(redis_url=redis_server.url, model=model, cwd=TESTS) as pool:
        yield pool


def test_a_script_answers_a_denied_approval_differently_from_an_approved_one(shared_pool):
    pool = shared_pool
    denied = pool.run("pool_agents:refunds", "Refund order A-17", script=CREDIT)
    assert denied.status == "waiting_approval" and denied.pending[0]["name"] == "issue_credit"
    denied = pool.approve(denied.id, approved=False, reason="over the monthly limit")
    approved = pool.run("pool_agents:refunds", "Refund order A-17", script=CREDIT)
    approved = pool.approve(approved.id)

    assert (denied.status, denied.result) == ("completed", "I could not issue the credit.")
    assert (approved.status, approved.result) == ("completed", "Credit issued.")
    assert pool.model.stats()["rejected"] == 0, pool.model.stats()["rejections"]


def test_a_script_function_sees_the_step_the_task_and_the_last_tool_results(shared_pool):
    pool = shared_pool
    seen: list[tuple[int, str | None]] = []

    def support(request: ScriptRequest) -> dict | None:
        seen.append((request.step, request.last_result and request.last_result.tool))
        if request.step == 0:
            order = request.task.split()[-1]  # each run asks about its own order
            return {"tool_calls": [{"name": "order_status", "input": {"order": order}}]}
        return {"text": f"Status: {request.result_of('order_status').content}"}

    pool.set_scripts({"default": support})
    runs = [pool.run("pool_agents:refunds", f"Where is order {order}") for order in ("A-1", "B-2")]

    assert [run.result for run in runs] == [
        "Status: order A-1: shipped on Monday",
        "Status: order B-2: shipped on Monday",
    ]
    assert sorted(seen) == [(0, None), (0, None), (1, "order_status"), (1, "order_status")]


def test_a_script_that_matches_no_branch_or_raises_fails_the_run_with_the_reason(shared_pool):
    pool = shared_pool
    unmatched = [CREDIT[0], {"branches": [{"when": {"is_error": True}, "text": "denied"}]}]
    run = pool.run("pool_agents:refunds", "Refund order A-17", script=unmatched)
    run = pool.approve(run.id)
    assert run.status == "failed" and "no branch's `when` matches" in run.error

    run = pool.run("pool_agents:refunds", "Where is A-1", script=lambda request: {"text": 1 / 0})
    assert run.status == "failed" and "the script function failed: ZeroDivisionError" in run.error


def test_a_script_plays_a_model_that_calls_an_unknown_tool_and_gives_a_tool_bad_input(shared_pool):
    """The model's mistakes a test author scripts: agentpool answers each with an is_error result, the
    run goes on, and the next step can react to it."""
    pool = shared_pool
    mistakes = [
        {"tool_calls": [{"name": "cancel_order", "input": {"order": "A-17"}}]},  # refunds has no such tool
        {"tool_calls": [{"name": "order_status", "input": {"order": 17}}]},  # a number where a str is due
        {
            "branches": [
                {"when": {"tool": "order_status", "is_error": True, "result_contains": "valid string"}, "text": "ok"},
                {"text": "the bad input reached the tool"},
            ]
        },
    ]
    run = pool.run("pool_agents:refunds", "Cancel order A-17", script=mistakes)

    assert (run.status, run.result) == ("completed", "ok"), run.error
    results = [b for m in run.messages if m["role"] == "user" and isinstance(m["content"], list) for b in m["content"]]
    assert [(r["is_error"], r["content"].split(".")[0]) for r in results] == [
        (True, "There is no tool named 'cancel_order'"),
        (True, "invalid input for order_status: order: Input should be a valid string"),
    ]
    assert pool.model.stats()["rejected"] == 0, pool.model.stats()["rejections"]


def test_malformed_branches_are_refused_when_the_script_is_set():
    for bad, says in (
        ({"branches": []}, "non-empty list"),
        ({"branches": [{"when": {"is_eror": True}, "text": "x"}]}, "unknown keys ['is_eror']"),
        ({"branches": [{"text": "x"}], "text": "y"}, "no other keys"),
        ({"branches": [{"when": {"result_matches": "("}}]}, "not a regular expression"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            ScriptedModel({"s": [bad]})


def test_a_scripted_model_can_be_one_function_answering_over_http():
    def echo(request: ScriptRequest) -> dict:
        return {"text": f"step {request.step}: {request.task}"}

    with ScriptedModel(echo) as model:
        client = anthropic.Anthropic(base_url=model.base_url, api_key="sk-test", max_retries=0)
        reply = client.messages.create(
            model="claude-sonnet-5-5", max_tokens=100, messages=[{"role": "user", "content": "hello"}]
        )
    assert reply.content[0].text == "step 0: hello"


APP = '''
from agentpool import Agent, tool

@tool(effect="read")
def lookup(order: str) -> str:
    """Where an order is."""
    return f"{order} ships today"

support = Agent(model="claude-sonnet-5-5", system="You answer order questions.", tools=[lookup], max_turns=5)
'''

SLOW_LOOKUP = [
    {"tool_calls": [{"name": "lookup", "input": {"order": "A-17"}}], "delay": 1.0},
    {"text": "A-17 ships today."},
]


def test_local_pool_runs_an_apps_own_agents_and_survives_a_killed_worker(tmp_path, monkeypatch):
    (tmp_path / "shop_agents.py").write_text(textwrap.dedent(APP))
    monkeypatch.chdir(tmp_path)  # workers import agents from the current directory, as `agentpool worker` does

    with local_pool(SLOW_LOOKUP, workers=1) as pool:
        run_id = pool.enqueue("shop_agents:support", "Where is A-17?")
        killed = pool.kill_turn(run_id)  # the worker holding this run's turn, mid-turn: or NothingKilled
        pool.start_workers(1)
        run = pool.wait(run_id)
        assert (run.status, run.result) == ("completed", "A-17 ships today."), pool.logs()
        assert (killed.what, killed.run_id, killed.worker) == ("worker", run_id, 0)
        assert pool.kills == [killed]
        url = pool.redis_url
    assert pool.workers.alive() == []
    with pytest.raises(RedisError), Redis.from_url(url, socket_connect_timeout=1) as gone:
        gone.ping()  # the throwaway redis-server is gone with the pool


# An app whose unsafe tool leaves a trace of each charge where the test can count them.
SHOP = """
import os
from pathlib import Path

from agentpool import Agent, tool

CHARGES = Path(os.environ["SHOP_CHARGES"])


def charges(order):
    return CHARGES.read_text().split().count(order) if CHARGES.exists() else 0


@tool(effect="unsafe")
def charge(order: str) -> str:
    \"\"\"Charge an order's card.\"\"\"
    with CHARGES.open("a") as ledger:
        ledger.write(order + "\\n")
    return f"charged {order}"


@tool(effect="unsafe")
def charge_checked(order: str) -> str:
    \"\"\"Charge an order's card; the bank tells whether it was.\"\"\"
    return charge(order)


@charge_checked.verify
def _was_charged(order: str, idempotency_key: str) -> str | None:
    return f"charged {order}" if charges(order) else None


@tool(effect="read")
def lookup(order: str) -> str:
    \"\"\"Where an order is.\"\"\"
    return f"{order} ships today"


cashier = Agent(model="claude-sonnet-5-5", tools=[charge, charge_checked, lookup], max_turns=5)
"""


def _charge(tool: str = "charge", delay: float = 0.0) -> list[dict]:
    return [
        {"tool_calls": [{"name": tool, "input": {"order": "A-17"}}], "delay": delay},
        {
            "branches": [
                {"when": {"tool": tool, "result_contains": "unknown"}, "text": "The charge may not have gone through."},
                {"when": {"tool": tool, "result_contains": "charged A-17"}, "text": "Charged."},
                {"text": "A-17 ships today."},
            ]
        },
    ]


@pytest.fixture
def shop(tmp_path, monkeypatch):
    (tmp_path / "shop.py").write_text(textwrap.dedent(SHOP))
    charges = tmp_path / "charges.txt"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHOP_CHARGES", str(charges))
    return lambda: charges.read_text().split().count("A-17") if charges.exists() else 0


def _in_progress(pool: LocalPool, run_id: str) -> None:
    deadline = time.monotonic() + 30
    while (pool.get(run_id).waiting or {}).get("kind") != "in_progress":
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.02)


def test_kill_turn_kills_the_worker_running_that_run_not_the_first_one(shop):
    gate = threading.Event()

    def held(request: ScriptRequest) -> dict:  # the first run's model call waits until the test lets it go
        if request.step == 0:
            gate.wait(60)
            return {"tool_calls": [{"name": "lookup", "input": {"order": "A-17"}}]}
        return {"text": "A-17 ships today."}

    with local_pool(workers=1) as pool:
        first = pool.enqueue("shop:cashier", "Where is A-17?", script=held)
        _in_progress(pool, first)  # worker 0 is busy with it
        pool.start_workers(1)
        deadline = time.monotonic() + 60
        while Worker.count(connection=pool.redis) < 2:
            assert time.monotonic() < deadline, pool.logs()
            time.sleep(0.05)
        second = pool.enqueue("shop:cashier", "Where is A-17 now?", script=_charge("lookup", delay=2))

        killed = pool.kill_turn(second)  # kill_worker() would have killed worker 0, running `first`
        gate.set()

        assert (killed.worker, killed.what, killed.run_id) == (1, "worker", second)
        assert [p.poll() is None for p in pool.workers.procs] == [True, False]
        done = [pool.wait(first), pool.wait(second)]  # worker 0 takes the killed run over
        assert [run.status for run in done] == ["completed", "completed"], pool.logs()
        assert "takeover" in [f["kind"] for _id, f in read_events(pool.redis, second)]
        assert "takeover" not in [f["kind"] for _id, f in read_events(pool.redis, first)]


def test_kill_turn_with_horse_only_leaves_the_worker_to_hand_the_turn_over_at_once(shop):
    with local_pool(workers=1) as pool:
        run_id = pool.enqueue("shop:cashier", "Where is A-17?", script=_charge("lookup", delay=3))
        killed = pool.kill_turn(run_id, horse_only=True)
        run = pool.wait(run_id)  # no other worker: the horse's own worker takes the turn again
        assert (killed.what, killed.worker) == ("horse", 0) and pool.workers.procs[0].poll() is None
        assert run.status == "completed", run
        takeovers = [f for _id, f in read_events(pool.redis, run_id) if f["kind"] == "takeover"]
        assert [f["cause_kind"] for f in takeovers] == ["horse_death"], takeovers


def test_a_kill_inside_the_tool_is_reconciled_and_the_unsafe_charge_is_not_repeated(shop):
    with local_pool(workers=1) as pool:  # a forking worker: the horse dies there, its worker hands over
        run = pool.run("shop:cashier", "Charge A-17", script=_charge(), kill_at="in_tool", kill_tool="charge")
        (killed,) = pool.kills
    assert (killed.what, killed.worker, killed.run_id) == ("in_tool", 0, run.id)
    assert (run.status, run.result) == ("completed", "The charge may not have gone through."), run
    assert shop() == 1, "charged once, never again by the takeover"


def test_a_crash_test_that_crashes_nothing_fails(shop):
    with local_pool(workers=1) as pool:
        with pytest.raises(NothingKilled, match=r"never reached in_tool"):
            pool.run("shop:cashier", "Where is A-17?", script=_charge("lookup"), kill_at="in_tool", kill_tool="charge")
        done = pool.run("shop:cashier", "Where is A-17?", script=_charge("lookup"))
        with pytest.raises(NothingKilled, match=r"is completed: no worker holds a turn"):
            pool.kill_turn(done.id)
        with pytest.raises(ValueError, match="kill_at must be one of"):
            pool.enqueue("shop:cashier", "x", kill_at="in_tol")
        with pytest.raises(ValueError, match="kill_tool goes with a tool's point"):
            pool.enqueue("shop:cashier", "x", kill_at="after_save_a", kill_tool="charge")
        assert pool.kills == []
        legacy = pool.kill_worker()  # the old call: the first live worker, whatever it runs
        assert (legacy.worker, legacy.what, legacy.run_id) == (0, "worker", None)


def test_a_lost_machine_mid_charge_is_verified_at_once_with_the_kits_fast_takeover(shop):
    # A whole worker lost inside the tool leaves an attempt that may still be running elsewhere: the
    # takeover waits for the tool's timeout (120 s here) + the takeover margin (5 s) before it asks
    # `verify`. The kit's fast setting makes that wait a second.
    with local_pool(workers=2, tool_timeout=1.0, takeover_margin=0.2) as pool:
        run = pool.run(
            "shop:cashier", "Charge A-17", script=_charge("charge_checked"), kill_at="in_tool", whole_worker=True
        )
        (killed,) = pool.kills
        assert killed.what == "in_tool" and pool.workers.procs[killed.worker].poll() is not None, "the whole worker"
        waits = [
            float(f["seconds"]) for _id, f in read_events(pool.redis, run.id) if f["kind"] == "waiting_for_attempt"
        ]
        assert all(seconds <= 1.2 for seconds in waits), waits  # the attempt's 1 s timeout + 0.2 s, not 125 s
    assert (run.status, run.result) == ("completed", "Charged."), run
    assert shop() == 1


CONFTEST = 'pytest_plugins = ["agentpool.testing.pytest_plugin"]\n'
PLUGIN_TEST = """
def test_support_answers(agentpool_pool):
    run = agentpool_pool.run("shop_agents:support", "Where is A-17?", script=[
        {"tool_calls": [{"name": "lookup", "input": {"order": "A-17"}}]},
        {"branches": [{"when": {"result_contains": "ships today"}, "text": "Today."}, {"text": "Unknown."}]},
    ])
    assert (run.status, run.result) == ("completed", "Today.")
"""


def test_the_pytest_plugin_gives_a_test_a_pool_in_one_fixture(tmp_path):
    (tmp_path / "shop_agents.py").write_text(textwrap.dedent(APP))
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shop.py").write_text(textwrap.dedent(PLUGIN_TEST))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout


@tool(effect="idempotent")
def open_ticket(title: str, *, idempotency_key: str) -> str:
    """Open a ticket."""
    call = current_call()
    return f"{title} by {call.run_id}/{call.tool_use_id} key {idempotency_key}"


@tool(effect="read", timeout=0.2)
async def slow_search(query: str) -> str:
    """Search, slowly."""
    await asyncio.sleep(5)
    return query


@tool(effect="read")
def broken(item: str) -> str:
    """Always fails."""
    raise RuntimeError(f"no {item}")


def test_call_tool_runs_a_tool_as_a_worker_does():
    text = call_tool(open_ticket, title="Changelog", run_id="r_1", tool_use_id="toolu_9")
    assert text == f"Changelog by r_1/toolu_9 key {idempotency_key('r_1', 'toolu_9')}"
    with pytest.raises(ToolInputError, match="invalid input for open_ticket: title"):
        call_tool(open_ticket, {"title": ["not", "text"]})
    with pytest.raises(ToolInputError, match="Extra inputs are not permitted"):
        call_tool(open_ticket, title="x", idempotency_key="mine")  # the key is the runner's, never the model's
    with pytest.raises(RuntimeError, match="no kettle"):
        call_tool(broken, item="kettle")
    assert current_call() is None, "set only during the call"

    with tool_context(run_id="r_2") as call:
        assert current_call() == call and call.idempotency_key == idempotency_key("r_2", "toolu_test")


def test_tool_result_is_what_the_model_would_be_sent():
    assert tool_result(broken, item="kettle").is_error
    assert "broken failed: RuntimeError: no kettle" in tool_result(broken, item="kettle").content
    bad = tool_result(open_ticket, title=3)
    assert bad.is_error and "title" in bad.content
    late = tool_result(slow_search, query="x")
    assert late.is_error and "timed out after 0.2 s" in late.content
    assert tool_result(open_ticket, title="y" * 50, max_result_chars=10).content.startswith("y" * 10 + "\n[... cut")


def _use(*ids: str) -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "lookup", "input": {}} for i in ids]}


def _results(*ids: str, text: str | None = None) -> dict:
    content: list[dict] = [{"type": "tool_result", "tool_use_id": i, "content": "ok"} for i in ids]
    if text is not None:
        content.insert(0, {"type": "text", "text": text})
    return {"role": "user", "content": content}


TASK = {"role": "user", "content": "Look it up."}
# Conversations the Messages API refuses; the first is what a save point B landing on a primary that
# lost save point A leaves (issue 20, item 2): a tool_result for a tool_use the conversation never had.
REFUSED = {
    "stray result": [TASK, _results("toolu_a")],
    "result of an older turn": [TASK, _use("toolu_a"), _results("toolu_a"), _use("toolu_b"), _results("toolu_a")],
    "result twice": [TASK, _use("toolu_a"), _results("toolu_a", "toolu_a")],
    "result not first": [TASK, _use("toolu_a"), _results("toolu_a", text="Also:")],
    "result missing": [TASK, _use("toolu_a", "toolu_b"), _results("toolu_a")],
    "tool_use id reused": [TASK, _use("toolu_a"), _results("toolu_a"), _use("toolu_a"), _results("toolu_a")],
    "result in an assistant message": [
        TASK,
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "ok"}]},
    ],
    "an empty message": [TASK, {"role": "assistant", "content": []}, TASK],
}


@pytest.mark.parametrize("name", REFUSED)
def test_assert_valid_conversation_refuses_what_the_scripted_model_refuses_in_its_words(name, model):
    messages = REFUSED[name]
    tools = [{"name": "lookup", "input_schema": {"type": "object"}}]
    with (
        anthropic.Anthropic(base_url=model.base_url, api_key="k", max_retries=0) as client,
        pytest.raises(anthropic.BadRequestError) as refused,
    ):
        client.messages.create(model="claude-sonnet-5-5", max_tokens=64, messages=messages, tools=tools)
    with pytest.raises(AssertionError) as failed:
        assert_valid_conversation(messages)
    assert refused.value.body["error"]["message"] in str(failed.value)


def test_assert_valid_conversation_passes_what_a_run_writes_and_keeps_agentpools_order():
    answered = _results("toolu_a", "toolu_b")
    answered["content"].append({"type": "text", "text": "And a message sent meanwhile."})
    assert_valid_conversation([TASK, _use("toolu_a", "toolu_b"), answered, {"role": "assistant", "content": "Done."}])
    with pytest.raises(AssertionError, match="in order"):  # the API takes any order; agentpool writes tool_use order
        assert_valid_conversation([TASK, _use("toolu_a", "toolu_b"), _results("toolu_b", "toolu_a")])
