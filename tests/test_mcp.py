"""MCP servers' tools in agent runs: real MCP server processes (tests/mcp_servers.py, the SDK's
MCPServer) over stdio, started by the workers, and over streamable HTTP, started by the test; real
worker processes; crashes by SIGKILL. Every real execution is counted by the servers themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from re import escape as re_escape

import pytest
from test_concurrency import start_threaded, worker_process

from agentpool import Agent, ToolInputError, enqueue_run, wait_for_run
from agentpool.mcp_tools import effect_from_annotations
from agentpool.runtime.mcp_hub import McpToolFailed
from agentpool.testing.localpool import free_port, horses_of

from conftest import TESTS, assert_valid_conversation, script_task

SERVERS = str(Path(__file__).parent / "mcp_servers.py")


def _effects(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def mcp_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "gates").mkdir()
    return {
        "MCP_TEST_EFFECTS": str(tmp_path / "mcp-effects.jsonl"),
        "MCP_TEST_HIDDEN": str(tmp_path / "hidden.txt"),
        "MCP_TEST_GATES": str(tmp_path / "gates"),
    }


class HttpServer:
    """The CRM over streamable HTTP, in a process of the test's own (as a team's MCP server would be)."""

    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.env, self.logdir, self.proc = env, logdir, None

    def start(self) -> HttpServer:
        self.log = log = open(self.logdir / "mcp-http.log", "ab")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, SERVERS, "crm", "http", str(self.port)],
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        import socket

        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            assert self.proc.poll() is None, (self.logdir / "mcp-http.log").read_text()
            time.sleep(0.05)
        raise AssertionError("the MCP HTTP server did not start")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(params=["stdio", "http"])
def crm_transport(request, mcp_env, tmp_path):
    if request.param == "stdio":
        yield {}
        return
    server = HttpServer(mcp_env, tmp_path).start()
    yield {"MCP_CRM_URL": server.url}
    server.stop()


WORK = [
    {"tool_calls": [{"name": "mcp__docs__search_docs", "input": {"query": "refund policy"}}]},
    {"tool_calls": [{"name": "mcp__crm__tag_customer", "input": {"customer": "acme", "tag": "vip"}}]},
    {"tool_calls": [{"name": "mcp__crm__delete_customer", "input": {"customer": "globex"}}]},
    {"tool_calls": [{"name": "mcp__docs__search_docs", "input": {"query": "deletion"}}]},
    {"text": "Done."},
]


def _results(run) -> dict[str, dict]:
    uses = {
        b["id"]: b["name"]
        for m in run.messages
        if m["role"] == "assistant"
        for b in m["content"]
        if b["type"] == "tool_use"
    }
    return {
        uses[b["tool_use_id"]] + f"#{i}": b
        for i, m in enumerate(run.messages)
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
    }


def _run_to_end(r, pool, model, agent: str, steps: list[dict], *, timeout: float = 180, **worker_env: str):
    """One worker, and one run of ``agent`` whose model follows ``steps``, waited for until it completed."""
    model.set_scripts({"steps": steps})
    pool.start(1, **worker_env)
    run = wait_for_run(enqueue_run(agent, script_task("steps"), connection=r), timeout=timeout, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    return run


def test_an_agent_uses_tools_of_two_mcp_servers_over_one_session_each(r, pool, model, mcp_env, crm_transport, tmp_path):
    run = _run_to_end(r, pool, model, "mcp_agents:support", WORK, **mcp_env, **crm_transport)

    assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    texts = [b["content"] for b in _results(run).values()]
    assert texts == [
        "3 pages about refund policy: setup, billing, limits",
        "tagged acme vip",
        "deleted globex",
        "3 pages about deletion: setup, billing, limits",
    ]
    effects = _effects(tmp_path / "mcp-effects.jsonl")
    assert [e["tool"] for e in effects] == ["search_docs", "tag_customer", "delete_customer", "search_docs"]
    assert effects[1]["key"].startswith("ap-"), "an idempotent tool's key argument is the run's stable key"
    docs_pids = {e["pid"] for e in effects if e["tool"] == "search_docs"}
    assert len(docs_pids) == 1, "five turns (five work horses) share the worker's one docs server process"


def _wait_for(path: Path, tool: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in _effects(path) if e["tool"] == tool]
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"{tool} never ran")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.crash
def test_work_horses_killed_after_each_mcp_call_never_repeat_the_destructive_one(
    r, pool, model, mcp_env, crm_transport, tmp_path
):
    """The two-server agent, its horse SIGKILLed in every turn after the tool took effect and before its
    outcome was recorded: the read-only server's tool runs again, the idempotent one again with the same
    key, the destructive one never again (the model is told its status is unknown)."""
    model.set_scripts({"work": WORK})
    pool.start(2, AGENTPOOL_FAULTS="in_tool", **mcp_env, **crm_transport)
    run_id = enqueue_run("mcp_agents:support", script_task("work"), connection=r)
    run = wait_for_run(run_id, timeout=180, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    assert len(list(tmp_path.glob(f"fault-in_tool-{run_id}-*"))) == 4, "every tool's horse was killed once"
    effects = _effects(tmp_path / "mcp-effects.jsonl")
    by_tool = Counter(e["tool"] for e in effects)
    assert by_tool["delete_customer"] == 1, "a destructive MCP tool is never called twice"
    assert by_tool["search_docs"] == 4, "a read-only MCP tool is called again"
    assert by_tool["tag_customer"] == 2 and len({e["key"] for e in effects if e["tool"] == "tag_customer"}) == 1
    results = _results(run)
    deleted = next(b for name, b in results.items() if name.startswith("mcp__crm__delete_customer"))
    assert deleted.get("is_error") and "status of this mcp__crm__delete_customer call is unknown" in deleted["content"]


@pytest.mark.crash
def test_a_horse_killed_mid_call_stops_its_stdio_server_before_the_takeover(r, pool, model, mcp_env, tmp_path):
    """The call runs in the worker's hub, not the horse: when the horse dies, the server process with its
    call still in flight is stopped before the turn is handed over, so the delete cannot land after the
    takeover told the model its status is unknown; the next call gets a new server."""
    model.set_scripts(
        {
            "held": [
                {"tool_calls": [{"name": "mcp__crm__held_delete", "input": {"customer": "initech", "gate": "g1"}}]},
                {"tool_calls": [{"name": "mcp__crm__refund", "input": {"customer": "initech", "amount_cents": 5}}]},
                {"text": "Checked."},
            ]
        }
    )
    worker = pool.start(1, **mcp_env)[0]
    run_id = enqueue_run("mcp_agents:support", script_task("held"), connection=r)
    started = _wait_for(tmp_path / "mcp-effects.jsonl", "held_delete_started")
    for horse in horses_of(worker.pid):
        os.kill(horse, signal.SIGKILL)
    run = wait_for_run(run_id, timeout=180, connection=r)
    (tmp_path / "gates" / "g1").touch()  # too late: its server is gone

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    assert not _alive(started["pid"]), "the server holding the dead horse's call was stopped"
    effects = _effects(tmp_path / "mcp-effects.jsonl")
    assert [e["tool"] for e in effects] == ["held_delete_started", "refund"]
    assert effects[1]["pid"] != started["pid"], "the next call connected again"
    held = next(b for name, b in _results(run).items() if name.startswith("mcp__crm__held_delete"))
    assert held.get("is_error") and "is unknown" in held["content"]


@pytest.mark.crash
def test_a_tool_gone_from_its_server_at_the_takeover_is_reconciled_as_a_tool_the_agent_lost(
    r, pool, model, mcp_env, tmp_path
):
    """A read-only tool would simply run again after a crash; one its server no longer lists when the
    takeover connects is not called (there is nothing to call): its result says the status is unknown."""
    model.set_scripts(
        {
            "gone": [
                {"tool_calls": [{"name": "mcp__docs__held_search", "input": {"query": "sla", "gate": "g1"}}]},
                {"tool_calls": [{"name": "mcp__docs__search_docs", "input": {"query": "sla"}}]},
                {"text": "Found it."},
            ]
        }
    )
    worker = pool.start(1, **mcp_env)[0]
    run_id = enqueue_run("mcp_agents:support", script_task("gone"), connection=r)
    _wait_for(tmp_path / "mcp-effects.jsonl", "held_search_started")
    Path(mcp_env["MCP_TEST_HIDDEN"]).write_text("held_search\n")  # the next docs server lacks it
    for horse in horses_of(worker.pid):
        os.kill(horse, signal.SIGKILL)
    run = wait_for_run(run_id, timeout=180, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    tools = [e["tool"] for e in _effects(tmp_path / "mcp-effects.jsonl")]
    assert tools == ["held_search_started", "search_docs"], "the vanished tool was not called again"
    held = next(b for name, b in _results(run).items() if name.startswith("mcp__docs__held_search"))
    assert held.get("is_error") and "status of this mcp__docs__held_search call is unknown" in held["content"]


def test_a_server_that_dies_mid_call_leaves_the_calls_status_unknown(r, pool, model, mcp_env, crm_transport, tmp_path):
    """The charge took effect and the server died before answering: its stdio pipe closed, or its HTTP
    response stream ended. The SDK raises an MCPError of its own for that, which is no reply of the
    server's: the model is told (and the ledger records) that whether the charge took effect is unknown,
    as after a timeout, never that the server answered with an error."""
    steps = [
        {"tool_calls": [{"name": "mcp__crm__charge", "input": {"customer": "acme", "amount_cents": 500}}]},
        {"text": "Checked."},
    ]
    run = _run_to_end(r, pool, model, "mcp_agents:support", steps, **mcp_env, **crm_transport)

    assert_valid_conversation(run.messages)
    (charge,) = _results(run).values()
    assert charge.get("is_error") and "whether charge took effect is unknown" in charge["content"], charge
    assert "answered" not in charge["content"], "a lost connection is no answer of the server's"
    assert [e["tool"] for e in _effects(tmp_path / "mcp-effects.jsonl")] == ["charge"]


def test_a_servers_error_reply_fails_the_call_and_keeps_its_session(r, pool, model, mcp_env, tmp_path):
    """A JSON-RPC error the server sent (invalid params) is its answer: the call failed (not "unknown"),
    and the session is sound, so the next call goes to the same server process, not a new one (a reset
    would also end other runs' calls in flight on that session)."""
    steps = [
        {"tool_calls": [{"name": "mcp__crm__strict_refund", "input": {"customer": "acme", "amount_cents": 0}}]},
        {"tool_calls": [{"name": "mcp__crm__strict_refund", "input": {"customer": "acme", "amount_cents": 5}}]},
        {"text": "Refunded."},
    ]
    run = _run_to_end(r, pool, model, "mcp_agents:support", steps, **mcp_env)

    refused, refunded = _results(run).values()
    assert refused.get("is_error"), refused
    assert "answered strict_refund with an error: amount_cents must be positive" in refused["content"]
    assert "unknown" not in refused["content"]
    assert refunded["content"] == "refunded 5" and not refunded.get("is_error")
    first, second = _effects(tmp_path / "mcp-effects.jsonl")
    assert first["pid"] == second["pid"], "the server's error reply did not drop its session"


@pytest.mark.crash
def test_a_worker_killed_mid_call_takes_its_stdio_server_with_it(r, pool, model, mcp_env, tmp_path):
    """The SDK starts a stdio server in a session of its own, out of the worker's process group: a
    threaded worker SIGKILLed with a call in flight must still leave no server to complete it after the
    takeover told the model its status is unknown (the server dies with its worker: PR_SET_PDEATHSIG)."""
    model.set_scripts(
        {
            "held": [
                {"tool_calls": [{"name": "mcp__crm__held_delete", "input": {"customer": "initech", "gate": "g1"}}]},
                {"text": "Checked."},
            ]
        }
    )
    pool.env.update(mcp_env)
    child = worker_process(start_threaded(pool, "threaded-mcp", concurrency=2))
    run_id = enqueue_run("mcp_agents:support", script_task("held"), connection=r)
    started = _wait_for(tmp_path / "mcp-effects.jsonl", "held_delete_started")
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(started["pid"]):
        assert time.monotonic() < deadline, "the stdio server outlived the worker that started it"
        time.sleep(0.02)
    (tmp_path / "gates" / "g1").touch()
    run = wait_for_run(run_id, timeout=180, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    (held,) = _results(run).values()
    assert held.get("is_error") and "is unknown" in held["content"]
    assert [e["tool"] for e in _effects(tmp_path / "mcp-effects.jsonl")] == ["held_delete_started"]


def test_a_tool_whose_schema_cannot_be_applied_gives_an_error_result_and_the_run_goes_on(
    r, pool, model, mcp_env, tmp_path
):
    """A listed schema with a $ref to nothing passes jsonschema's schema check but breaks validation: the
    call is refused with an is_error result naming why (it used to crash the turn, again and again)."""
    steps = [{"tool_calls": [{"name": "mcp__broken__lookup", "input": {"q": "x"}}]}, {"text": "ok"}]
    run = _run_to_end(r, pool, model, "mcp_agents:broken_schema", steps, timeout=60, **mcp_env)

    (lookup,) = _results(run).values()
    assert lookup.get("is_error") and "inputSchema cannot be checked" in lookup["content"], lookup
    assert _effects(tmp_path / "mcp-effects.jsonl") == [], "a call whose input was not checked is not made"


def test_a_server_that_times_out_gives_an_error_result_and_is_connected_again(r, pool, model, mcp_env, tmp_path):
    steps = [
        {"tool_calls": [{"name": "mcp__docs__slow_search", "input": {"query": "q", "seconds": 30}}]},
        {"tool_calls": [{"name": "mcp__docs__search_docs", "input": {"query": "q"}}]},
        {"text": "ok"},
    ]
    run = _run_to_end(r, pool, model, "mcp_agents:impatient", steps, timeout=120, **mcp_env)

    slow, search = _results(run).values()
    assert slow.get("is_error") and "slow_search" in slow["content"] and "1 s" in slow["content"]
    assert search["content"] == "3 pages about q: setup, billing, limits" and not search.get("is_error")
    effects = _effects(tmp_path / "mcp-effects.jsonl")
    assert effects[0]["pid"] != effects[1]["pid"], "the server that timed out was replaced"


def test_an_http_server_that_went_down_gives_an_error_result_and_is_reached_again_once_back(
    r, pool, model, mcp_env, tmp_path
):
    server = HttpServer(mcp_env, tmp_path).start()
    model.set_scripts(
        {
            "down": [
                {"tool_calls": [{"name": "mcp__docs__held_search", "input": {"query": "a", "gate": "g1"}}]},
                {"tool_calls": [{"name": "mcp__crm__refund", "input": {"customer": "acme", "amount_cents": 100}}]},
                {"tool_calls": [{"name": "mcp__docs__held_search", "input": {"query": "b", "gate": "g2"}}]},
                {"tool_calls": [{"name": "mcp__crm__refund", "input": {"customer": "acme", "amount_cents": 100}}]},
                {"text": "Refunded."},
            ]
        }
    )
    gates = tmp_path / "gates"
    try:
        pool.start(1, **mcp_env, MCP_CRM_URL=server.url)
        run_id = enqueue_run("mcp_agents:support", script_task("down"), connection=r)
        _wait_for(tmp_path / "mcp-effects.jsonl", "held_search_started")
        server.stop()
        (gates / "g1").touch()
        deadline = time.monotonic() + 60
        while sum(e["tool"] == "held_search_started" for e in _effects(tmp_path / "mcp-effects.jsonl")) < 2:
            assert time.monotonic() < deadline, pool.logs()
            time.sleep(0.02)
        server.start()
        (gates / "g2").touch()
        run = wait_for_run(run_id, timeout=180, connection=r)
    finally:
        server.stop()

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    refunds = [b for name, b in _results(run).items() if name.startswith("mcp__crm__refund")]
    assert refunds[0].get("is_error") and "MCP server crm" in refunds[0]["content"]
    assert refunds[1]["content"] == "refunded 100" and not refunds[1].get("is_error")
    assert [e["tool"] for e in _effects(tmp_path / "mcp-effects.jsonl")].count("refund") == 1


def test_a_call_after_an_http_server_restarted_while_idle_runs_once_on_a_new_session(r, pool, model, mcp_env, tmp_path):
    """The CRM is redeployed between two turns: the worker's session is unknown to the new process, which
    answers 404 to the next call (the spec's "start a new session"). That request did nothing, so the
    unsafe refund is made again, once, on a new session: it runs exactly once and the model gets its result."""
    server = HttpServer(mcp_env, tmp_path).start()
    model.set_scripts(
        {
            "redeploy": [
                {"tool_calls": [{"name": "mcp__crm__refund", "input": {"customer": "acme", "amount_cents": 1}}]},
                {"tool_calls": [{"name": "mcp__docs__held_search", "input": {"query": "a", "gate": "g1"}}]},
                {"tool_calls": [{"name": "mcp__crm__refund", "input": {"customer": "acme", "amount_cents": 2}}]},
                {"text": "Refunded."},
            ]
        }
    )
    try:
        pool.start(1, **mcp_env, MCP_CRM_URL=server.url)
        run_id = enqueue_run("mcp_agents:support", script_task("redeploy"), connection=r)
        _wait_for(tmp_path / "mcp-effects.jsonl", "held_search_started")
        server.stop()
        server.start()
        (tmp_path / "gates" / "g1").touch()
        run = wait_for_run(run_id, timeout=180, connection=r)
    finally:
        server.stop()

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    refunds = [b for name, b in _results(run).items() if name.startswith("mcp__crm__refund")]
    assert [b["content"] for b in refunds] == ["refunded 1", "refunded 2"], refunds
    ran = [e for e in _effects(tmp_path / "mcp-effects.jsonl") if e["tool"] == "refund"]
    assert [e["amount_cents"] for e in ran] == [1, 2], "each refund ran exactly once"
    assert ran[0]["pid"] != ran[1]["pid"], "the second one on the restarted server"


def test_a_call_after_a_stdio_server_exited_while_idle_goes_to_a_new_one(r, pool, model, mcp_env, tmp_path):
    """The CRM's stdio process dies between two turns. Its process is gone before the next call is
    written, so that call is sent to a new server process, not into the dead one's pipe (which would
    leave the model with "whether refund took effect is unknown" for a refund that never ran)."""
    model.set_scripts(
        {
            "died": [
                {"tool_calls": [{"name": "mcp__crm__refund", "input": {"customer": "acme", "amount_cents": 1}}]},
                {"tool_calls": [{"name": "mcp__docs__held_search", "input": {"query": "a", "gate": "g1"}}]},
                {"tool_calls": [{"name": "mcp__crm__refund", "input": {"customer": "acme", "amount_cents": 2}}]},
                {"text": "Refunded."},
            ]
        }
    )
    pool.start(1, **mcp_env)
    run_id = enqueue_run("mcp_agents:support", script_task("died"), connection=r)
    first = _wait_for(tmp_path / "mcp-effects.jsonl", "refund")
    _wait_for(tmp_path / "mcp-effects.jsonl", "held_search_started")
    os.kill(first["pid"], signal.SIGKILL)
    (tmp_path / "gates" / "g1").touch()
    run = wait_for_run(run_id, timeout=180, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    refunds = [b for name, b in _results(run).items() if name.startswith("mcp__crm__refund")]
    assert [b["content"] for b in refunds] == ["refunded 1", "refunded 2"], refunds
    ran = [e for e in _effects(tmp_path / "mcp-effects.jsonl") if e["tool"] == "refund"]
    assert [e["amount_cents"] for e in ran] == [1, 2] and ran[0]["pid"] != ran[1]["pid"]


def test_an_mcp_tool_can_require_a_persons_approval(r, pool, model, mcp_env, tmp_path):
    from agentpool import approve, get_run

    from conftest import wait_for_status

    model.set_scripts(
        {
            "ask": [
                {"tool_calls": [{"name": "mcp__crm__delete_customer", "input": {"customer": "umbrella"}}]},
                {"text": "Gone."},
            ]
        }
    )
    pool.start(1, **mcp_env)
    run_id = enqueue_run("mcp_agents:gated", script_task("ask"), connection=r)
    wait_for_status(r, run_id, "waiting_approval", timeout=180)
    assert _effects(tmp_path / "mcp-effects.jsonl") == [], "nothing runs before the decision"
    approve(run_id, connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert [e["tool"] for e in _effects(tmp_path / "mcp-effects.jsonl")] == ["delete_customer"]
    assert get_run(run_id, connection=r).result == "Gone."


@pytest.mark.parametrize(
    ("annotations", "effect"),
    [
        ({"readOnlyHint": True}, "read"),
        ({"readOnlyHint": True, "destructiveHint": True}, "read"),
        ({"idempotentHint": True, "destructiveHint": False}, "idempotent"),
        ({"idempotentHint": True}, "unsafe"),  # destructiveHint defaults to true
        ({"destructiveHint": False}, "unsafe"),
        ({}, "unsafe"),
        (None, "unsafe"),
    ],
)
def test_an_mcp_tools_effect_class_comes_from_its_annotations(annotations, effect):
    assert effect_from_annotations(annotations) == effect


def test_tools_are_listed_named_classified_and_their_input_checked_strictly(mcp_env, tmp_path, monkeypatch):
    """Listed from the real servers in this process, as a worker does."""
    for name, value in mcp_env.items():
        monkeypatch.setenv(name, value)
    from agentpool.runtime.mcp_hub import attach

    agent = Agent(
        model="claude-sonnet-5-5",
        mcp_servers={"docs": _stdio("docs", mcp_env), "crm": _stdio("crm", mcp_env)},
        mcp_effects={"mcp__crm__set_tier": "unsafe"},
        mcp_requires_approval=["mcp__crm__refund"],
    )
    attach(agent)
    effects = {t.name: t.effect for t in agent.offered_tools}
    assert effects == {
        "mcp__docs__search_docs": "read",
        "mcp__docs__slow_search": "read",
        "mcp__docs__held_search": "read",
        "mcp__crm__delete_customer": "unsafe",
        "mcp__crm__tag_customer": "idempotent",
        "mcp__crm__set_tier": "unsafe",  # annotated idempotent, overridden
        "mcp__crm__refund": "unsafe",
        "mcp__crm__held_delete": "unsafe",
        "mcp__crm__failing_export": "unsafe",
        "mcp__crm__charge": "unsafe",
        "mcp__crm__strict_refund": "unsafe",
    }
    tag = agent.tool_named("mcp__crm__tag_customer")
    assert tag.takes_key and "idempotency_key" not in tag.to_param()["input_schema"]["properties"]
    assert "idempotency_key" not in tag.to_param()["input_schema"]["required"]
    assert agent.tool_named("mcp__crm__refund").requires_approval
    assert not agent.tool_named("mcp__crm__delete_customer").requires_approval
    search = agent.tool_named("mcp__docs__search_docs")
    assert search.validate({"query": "x", "limit": 2}) == {"query": "x", "limit": 2}
    for bad, problem in [
        ({"query": 7}, "query: 7 is not of type 'string'"),
        ({"query": "x", "limit": "2"}, "limit: '2' is not of type 'integer'"),
        ({}, "'query' is a required property"),
        ({"query": "x", "limit": float("nan")}, "not JSON"),
        ("x", "must be a JSON object"),
    ]:
        with pytest.raises(ToolInputError, match=re_escape(problem)):
            search.validate(bad)
    assert search.fn(query="billing") == "3 pages about billing: setup, billing, limits"
    with pytest.raises(McpToolFailed, match="export backend is down"):
        agent.tool_named("mcp__crm__failing_export").fn(customer="acme")


def test_a_server_that_refused_a_moment_ago_is_tried_again_at_once_when_called(mcp_env, tmp_path):
    """A refused connection costs nothing to retry: the call right after the server is back reaches it
    (only a connect attempt that hung keeps a server untried for a moment)."""
    from agentpool.mcp_tools import ServerConfig
    from agentpool.runtime.mcp_hub import Hub, McpUnavailable

    server = HttpServer(mcp_env, tmp_path)
    config = ServerConfig.of("crm", {"type": "http", "url": server.url})
    hub = Hub()
    try:
        with pytest.raises(McpUnavailable, match="MCP server crm is unavailable"):
            hub.call(config, "tag_customer", {"customer": "acme", "tag": "vip", "idempotency_key": "k1"}, 30)
        server.start()
        reply = hub.call(config, "tag_customer", {"customer": "acme", "tag": "vip", "idempotency_key": "k1"}, 30)
        assert not reply["is_error"], reply
    finally:
        hub.close()
        server.stop()


def test_a_call_a_dead_horse_wrote_that_the_hub_had_not_read_is_never_made(mcp_env, tmp_path):
    """A horse can write its request to the hub's socket and be killed before the hub reads it (the hub's
    loop was busy). The worker ends the horse's calls before its turn is handed over; the request read
    after that must be refused, or the delete lands after the takeover told the model it is unknown."""
    from agentpool.mcp_tools import ServerConfig
    from agentpool.runtime.mcp_hub import Hub

    server = HttpServer(mcp_env, tmp_path).start()
    spec = {"type": "http", "url": server.url}
    hub = Hub()
    try:
        hub.tools([ServerConfig.of("crm", spec)])  # connected, as a worker's preload leaves it
        hub.loop.call_soon_threadsafe(time.sleep, 3)  # the hub's loop is busy: nothing is read meanwhile
        call = (
            "import sys; from agentpool.mcp_tools import ServerConfig; from agentpool.runtime.mcp_hub import HubClient;"
            f"HubClient({hub.socket_path!r}, horse=7).call(ServerConfig.of('crm', {spec!r}), 'delete_customer',"
            " {'customer': 'globex'}, 30); sys.stdout.write('answered')"
        )
        horse = subprocess.Popen([sys.executable, "-c", call], stdout=subprocess.PIPE)
        time.sleep(1.5)  # the request is written (the horse waits for its reply)
        assert horse.poll() is None
        horse.kill()
        assert horse.communicate(timeout=10) == (b"", None) and horse.returncode == -signal.SIGKILL
        hub.end_calls_of(7, grace=5)  # what the worker does before it hands the dead horse's turn over
        time.sleep(2)  # the hub reads the dead horse's request now
        assert not any(e["tool"] == "delete_customer" for e in _effects(tmp_path / "mcp-effects.jsonl"))
        # The hub serves a horse that is still running as before.
        reply = hub.call(ServerConfig.of("crm", spec), "set_tier", {"customer": "acme", "tier": "gold"}, 30)
        assert not reply["is_error"], reply
        assert [e["tool"] for e in _effects(tmp_path / "mcp-effects.jsonl")] == ["set_tier"]
    finally:
        hub.close()
        server.stop()


def test_a_call_is_never_sent_after_its_timeout_however_long_the_connect_took(mcp_env, tmp_path):
    """A takeover takes a call to be over by its start plus its timeout (it may repeat an idempotent
    one after that). A call that had to connect first (its server had died) to a server slow to start
    must not be sent once its timeout has passed: it fails, not made, and the server never runs it."""
    from agentpool.mcp_tools import ServerConfig
    from agentpool.runtime.mcp_hub import Hub, McpUnavailable

    slow_start = f"sleep 3; exec {sys.executable} {SERVERS} crm stdio"
    config = ServerConfig.of("crm", {"type": "stdio", "command": "sh", "args": ["-c", slow_start], "env": mcp_env})
    hub = Hub()
    try:
        with pytest.raises(McpUnavailable, match="set_tier was not made: connecting took its whole 1 s timeout"):
            hub.call(config, "set_tier", {"customer": "acme", "tier": "gold"}, 1)
        time.sleep(1)
        assert _effects(tmp_path / "mcp-effects.jsonl") == []
        reply = hub.call(config, "set_tier", {"customer": "acme", "tier": "gold"}, 1)  # connected by now
        assert not reply["is_error"], reply
        assert [e["tool"] for e in _effects(tmp_path / "mcp-effects.jsonl")] == ["set_tier"]
    finally:
        hub.close()


def test_an_http_call_that_times_out_leaves_the_calls_in_flight_beside_it_on_their_session(mcp_env, tmp_path):
    """One slow call is not a broken session: the calls other runs have in flight on it go on and are
    answered (dropping the session under them made each one's outcome unknown)."""
    import threading

    from agentpool.mcp_tools import ServerConfig
    from agentpool.runtime.mcp_hub import Hub, McpUnavailable

    server = HttpServer(mcp_env, tmp_path).start()
    config = ServerConfig.of("crm", {"type": "http", "url": server.url})
    hub = Hub()
    try:
        hub.tools([config])
        replies: list = []
        other = threading.Thread(
            target=lambda: replies.append(hub.call(config, "held_delete", {"customer": "acme", "gate": "g2"}, 30))
        )
        other.start()
        _wait_for(tmp_path / "mcp-effects.jsonl", "held_delete_started")
        with pytest.raises(McpUnavailable, match="gave no answer to held_delete within 1 s"):
            hub.call(config, "held_delete", {"customer": "globex", "gate": "never"}, 1)
        (tmp_path / "gates" / "g2").touch()
        other.join(30)
        assert replies == [{"text": "deleted acme", "is_error": False}]
    finally:
        hub.close()
        server.stop()


def test_an_app_enqueueing_an_mcp_agent_starts_none_of_its_servers(redis_server, mcp_env):
    """enqueue_run checks the agent loads, in the app's process: that must not start its stdio servers
    (children of the app, with their tokens, left running) nor wait to connect to them. The app is a
    process of its own here: this one may hold servers other tests' hubs started."""
    app = """
import os, sys
from pathlib import Path
from agentpool import enqueue_run
enqueue_run("mcp_agents:support", "work [script:work]", connection=os.environ["REDIS_URL"])
def parent(p):
    try:
        return int((p / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None
mine = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and parent(p) == os.getpid()]
print(len(mine))
"""
    done = subprocess.run(
        [sys.executable, "-c", app],
        env={**os.environ, **mcp_env, "REDIS_URL": redis_server.url},
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", "the app started an MCP server"


class SilentServer:
    """An HTTP MCP server that hung: it accepts TCP connections and never answers. Counts the accepts,
    which is how many times a worker tried to connect."""

    def __init__(self) -> None:
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/mcp"
        self.held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(connection)  # kept open, never read or answered

    @property
    def attempts(self) -> int:
        return len(self.held)

    def close(self) -> None:
        self.listener.close()
        for connection in self.held:
            connection.close()


def test_a_hung_server_is_not_waited_on_in_every_turn(r, pool, model, mcp_env, tmp_path):
    """A server that accepts and never answers costs a connect attempt the whole connect timeout, and
    every turn lists the agent's tools (in a forking worker, once more in the preload before each fork):
    after an attempt that hung, the server is left untried for a while that doubles, so a run of sixteen
    tool turns connects a few times (1 s, 2 s, 4 s... apart), not once a turn. Its tools are simply not offered meanwhile."""
    silent = SilentServer()
    # Each model call takes a moment, as a real one does: longer than the first pause after a hung attempt.
    search = {"tool_calls": [{"name": "mcp__docs__search_docs", "input": {"query": "sla"}}], "delay": 0.6}
    model.set_scripts({"hung": [search] * 16 + [{"text": "Done."}]})
    try:
        # 4 s: time for the docs server, a stdio process importing the MCP SDK, to start on a loaded machine
        # (its connect runs beside the hung one's, under the same timeout).
        pool.start(1, AGENTPOOL_MCP_CONNECT_TIMEOUT="4", MCP_CRM_URL=silent.url, **mcp_env)
        run_id = enqueue_run("mcp_agents:support", script_task("hung"), connection=r)
        run = wait_for_run(run_id, timeout=180, connection=r)
        attempts = silent.attempts
    finally:
        silent.close()

    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)
    assert [b["content"] for b in _results(run).values()] == ["3 pages about sla: setup, billing, limits"] * 16
    # Doubling pauses: about five attempts in the run's 30 s or so (eight even if it took twice as long);
    # once a turn would be 17 or more.
    assert 1 <= attempts <= 8, f"{attempts} connect attempts in 17 turns: the hung server was waited on each turn"


def test_reprs_of_an_agent_and_its_server_configs_show_no_secret():
    """Tokens ride in a stdio server's env, an HTTP server's headers, and its URL (credentials, query):
    an agent or a server config printed in a log or a traceback shows none of them."""
    secrets = ["env-token-1", "header-token-2", "url-password-3", "query-token-4"]
    agent = Agent(
        model="claude-sonnet-5-5",
        mcp_servers={
            "docs": {"command": "docs-mcp", "env": {"DOCS_TOKEN": secrets[0]}},
            "crm": {
                "type": "http",
                "url": f"https://bot:{secrets[2]}@crm.internal:8443/mcp?key={secrets[3]}",
                "headers": {"Authorization": f"Bearer {secrets[1]}"},
            },
        },
    )
    shown = [repr(agent), repr(agent.mcp_configs), str(agent.mcp_configs["crm"]), str(agent.mcp_configs["docs"])]
    for text in shown:
        assert not [secret for secret in secrets if secret in text], text
    assert "DOCS_TOKEN" in shown[0] and "Authorization" in shown[0] and "crm.internal:8443/mcp" in shown[0]
    assert "DOCS_TOKEN" in shown[3] and "https://***@crm.internal:8443/mcp?***" in shown[2]
    assert agent.mcp_servers["crm"]["headers"]["Authorization"] == f"Bearer {secrets[1]}", "only the repr hides them"


def _stdio(kind: str, env: dict[str, str]) -> dict:
    return {"type": "stdio", "command": sys.executable, "args": [SERVERS, kind, "stdio"], "env": env}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mcp_servers": {"crm": {"type": "ws", "url": "ws://x"}}}, "type is 'stdio' or 'http'"),
        ({"mcp_servers": {"crm": {"type": "stdio"}}}, "needs a command"),
        ({"mcp_servers": {"crm": {"type": "http", "url": "localhost:1"}}}, "url starting with http"),
        ({"mcp_servers": {"crm": {"type": "http", "url": "http://x", "command": "y"}}}, "unknown keys"),
        ({"mcp_servers": {"a__b": {"command": "x"}}}, "server name 'a__b'"),
        ({"mcp_servers": {"crm": {"command": "x", "env": {"A": 1}}}}, "env maps strings to strings"),
        ({"mcp_servers": {"crm": {"command": "x"}}, "mcp_effects": {"mcp__erp__x": "read"}}, "names no tool"),
        ({"mcp_servers": {"crm": {"command": "x"}}, "mcp_effects": {"mcp__crm__x": "safe"}}, "must be one of"),
        ({"mcp_effects": {"mcp__crm__x": "read"}}, "there are none"),
    ],
)
def test_a_wrong_mcp_configuration_is_refused_when_the_agent_is_built(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=re_escape(message)):
        Agent(model="claude-sonnet-5-5", **kwargs)


def test_without_the_mcp_extra_the_agent_build_names_the_extra_and_nothing_else_needs_it():
    code = (
        "import sys; sys.modules['mcp'] = None\n"
        "import agentpool\n"
        "from agentpool import Agent, tool\n"
        "Agent(model='claude-sonnet-5-5')\n"
        "try:\n"
        "    Agent(model='claude-sonnet-5-5', mcp_servers={'crm': {'command': 'crm-server'}})\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=TESTS)
    assert out.stdout == "MCP servers need the mcp extra: pip install 'agentpool[mcp]'\n", out.stderr
    plain = "import sys, agentpool, agentpool.runtime.turn; print('mcp' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, check=True).stdout == "False\n"
