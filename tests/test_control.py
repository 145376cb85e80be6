"""Runs under control: approvals, budgets and resume, model errors, schema versions, retention."""

from __future__ import annotations

import base64
import json
import math
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from agentpool import (
    ApprovalError,
    InvalidLimit,
    ResumeRefused,
    approve,
    enqueue_run,
    get_run,
    resume,
    wait_for_run,
)
from agentpool.client import resume_needs
from agentpool.ops.dashboard import make_server
from agentpool.runtime.jobs import turn_queue
from agentpool.store.codec import pack
from agentpool.store.events import read as read_events
from agentpool.store.keys import RUNS, RunKeys
from agentpool.store.records import SCHEMA_VERSION

from conftest import ROOT, assert_valid_conversation, script_task, wait_for_status

DEPLOY = [
    {"tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {"tool_calls": [{"name": "deploy", "input": {"version": "2.4.1"}}]},
    {"text": "Deployed or not, I am done."},
]


def _tool_result(run, name):
    ids = {
        b["id"]: b["name"]
        for m in run.messages
        if m["role"] == "assistant"
        for b in m["content"]
        if b["type"] == "tool_use"
    }
    return next(
        b
        for m in run.messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result" and ids.get(b["tool_use_id"]) == name
    )


def test_an_approval_survives_a_worker_restart_and_the_call_runs_once(r, pool, model):
    model.set_scripts({"deploy": DEPLOY})
    first = pool.start(1)[0]
    run_id = enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r)
    wait_for_status(r, run_id, "waiting_approval")

    run = get_run(run_id, connection=r)
    assert run.pending == [{"id": run.pending[0]["id"], "name": "deploy", "input": {"version": "2.4.1"}}]
    assert not r.exists(RunKeys.of(run_id).lease), "nothing is leased while a run waits"
    assert turn_queue(r).count == 0, "nothing is queued while a run waits"
    pool.kill(first)  # every worker gone while the run waits

    out = pool.cli("approve", run_id)
    assert out.returncode == 0 and "approved" in out.stdout, out.stderr
    pool.start(1)
    done = wait_for_run(run_id, timeout=60, connection=r)
    assert done.status == "completed"
    assert _tool_result(done, "deploy")["content"] == "deployed 2.4.1"
    assert [e["tool"] for e in pool.effects()].count("deploy") == 1
    assert_valid_conversation(done.messages)


def test_a_read_asked_beside_a_call_that_waits_for_a_person_runs_once_after_the_decision(r, pool, model):
    """A read in the same reply as a call that needs approval is not started before the wait: it runs
    once, after the decision, as a first attempt (no reconciling, one tool_started)."""
    both = [{"name": "read_notes", "input": {"topic": "release"}}, {"name": "deploy", "input": {"version": "3"}}]
    model.set_scripts({"both": [{"tool_calls": both}, {"text": "done"}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("both"), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    assert not r.exists(RunKeys.of(run_id).ledger), "no call started before the decision"
    approve(run_id, connection=r)
    done = wait_for_run(run_id, timeout=60, connection=r)
    assert done.status == "completed"
    assert [e["tool"] for e in pool.effects()] == ["read_notes", "deploy"]
    kinds = [e["kind"] for _, e in read_events(r, run_id)]
    assert "reconciling" not in kinds and kinds.count("tool_started") == 2, kinds
    assert_valid_conversation(done.messages)


def test_a_denied_call_returns_the_reason_to_the_model_and_never_runs(r, pool, model):
    model.set_scripts({"deploy": DEPLOY})
    pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    out = pool.cli("approve", run_id, "--deny", "--reason", "release freeze until Monday")
    assert out.returncode == 0, out.stderr
    done = wait_for_run(run_id, timeout=60, connection=r)
    result = _tool_result(done, "deploy")
    assert result["is_error"] and "release freeze until Monday" in result["content"]
    assert "deploy" not in [e["tool"] for e in pool.effects()]
    assert done.status == "completed"
    shown = pool.cli("show", run_id)  # the ledger names the call although it never ran
    assert shown.returncode == 0, shown.stderr
    ledger = shown.stdout.split("\nledger:\n", 1)[1]
    ledger_line = next(line for line in ledger.splitlines() if result["tool_use_id"] in line)
    assert " deploy [not run] " in ledger_line, ledger_line


def test_decisions_are_bound_to_the_waiting_calls(r, pool, model):
    model.set_scripts(
        {
            "two": [
                {
                    "tool_calls": [
                        {"name": "deploy", "input": {"version": "1"}},
                        {"name": "deploy", "input": {"version": "2"}},
                    ]
                },
                {"text": "ok"},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("two"), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    first, second = [call["id"] for call in get_run(run_id, connection=r).pending]

    with pytest.raises(ApprovalError, match="not waiting for a decision on toolu_nope"):
        approve(run_id, "toolu_nope", connection=r)
    assert approve(run_id, first, connection=r) == [first]
    assert get_run(run_id, connection=r).status == "waiting_approval", "still waits on the second call"
    assert [c["id"] for c in get_run(run_id, connection=r).pending] == [second]
    with pytest.raises(ApprovalError, match="not waiting for a decision"):
        approve(run_id, first, connection=r)
    approve(run_id, second, approved=False, reason="one deploy is enough", connection=r)
    done = wait_for_run(run_id, timeout=60, connection=r)
    assert [e["version"] for e in pool.effects() if e["tool"] == "deploy"] == ["1"]
    with pytest.raises(ApprovalError, match="not waiting for approval"):
        approve(run_id, connection=r)
    assert_valid_conversation(done.messages)


def test_an_unanswered_approval_expires_and_the_run_goes_on(r, pool, model):
    model.set_scripts({"wipe": [{"tool_calls": [{"name": "wipe_cache", "input": {"region": "eu"}}]}, {"text": "ok"}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("wipe"), connection=r)
    wait_for_status(r, run_id, "waiting_approval")
    (asked,) = get_run(run_id, connection=r).pending
    wait_for_status(r, run_id, "completed", timeout=90)  # nobody answers: the reaper denies it
    done = get_run(run_id, connection=r)
    result = _tool_result(done, "wipe_cache")
    assert done.status == "completed"
    assert result["is_error"] and "expired" in result["content"]
    assert "wipe_cache" not in [e["tool"] for e in pool.effects()]
    # An approval that comes too late says what became of the call, not only that the run moved on.
    with pytest.raises(ApprovalError, match=f"{asked['id']} was denied already, automatically: its approval expired"):
        approve(run_id, asked["id"], connection=r)


def test_a_token_budget_stops_the_run_between_turns_and_resume_continues_it(r, pool, model):
    model.set_scripts(
        {
            "loop": [{"tool_calls": [{"name": "read_notes", "input": {"topic": str(i)}}]} for i in range(5)]
            + [{"text": "finished"}]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_total_tokens=300)
    stopped = wait_for_run(run_id, timeout=60, connection=r)
    assert stopped.status == "stopped" and "max_total_tokens=300" in stopped.error
    assert stopped.total_tokens >= 300 and stopped.turns < 6
    assert_valid_conversation(stopped.messages)

    resumed = resume(run_id, add_tokens=1_000_000, connection=r)
    assert resumed.status == "running"
    done = wait_for_run(run_id, timeout=60, connection=r)
    assert done.status == "completed" and done.turns == 6
    assert done.messages[: len(stopped.messages)] == stopped.messages, "resumed from the checkpoint"


def test_turn_and_cost_budgets_and_the_resume_command(r, pool, model):
    model.set_scripts(
        {
            "loop": [{"tool_calls": [{"name": "read_notes", "input": {"topic": str(i)}}]} for i in range(4)]
            + [{"text": "finished"}]
        }
    )
    pool.start(1)
    by_turns = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_turns=2)
    by_cost = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_cost_usd=0.001)
    assert wait_for_run(by_turns, timeout=60, connection=r).turns == 2
    costly = wait_for_run(by_cost, timeout=60, connection=r)
    assert costly.status == "stopped" and "max_cost_usd=0.001" in costly.error and costly.cost_usd >= 0.001

    out = pool.cli("resume", by_turns, "--add-turns", "10")
    assert out.returncode == 0, out.stderr
    assert wait_for_run(by_turns, timeout=60, connection=r).status == "completed"
    assert pool.cli("resume", by_turns).returncode == 1, "a completed run cannot be resumed"


def test_bursts_of_429_and_529_are_retried_and_a_spend_limit_stops_the_run(r, pool, model):
    model.set_scripts(
        {
            "burst": [
                {
                    "error": {
                        "status": 429,
                        "type": "rate_limit_error",
                        "message": "slow down",
                        "times": 3,
                        "retry_after": 0,
                    },
                    "tool_calls": [{"name": "read_notes", "input": {"topic": "a"}}],
                },
                {
                    "error": {"status": 529, "type": "overloaded_error", "message": "Overloaded", "times": 2},
                    "text": "done",
                },
            ],
            "broke": [
                {
                    "error": {
                        "status": 429,
                        "type": "rate_limit_error",
                        "times": 1,
                        "message": "This request would exceed your organization's monthly usage limit.",
                    }
                }
            ],
        }
    )
    pool.start(1, AGENTPOOL_MODEL_RETRIES="8")
    burst = enqueue_run("pool_agents:budgeted", script_task("burst"), connection=r)
    broke = enqueue_run("pool_agents:budgeted", script_task("broke"), connection=r)
    done = wait_for_run(burst, timeout=120, connection=r)
    assert done.status == "completed" and done.turns == 2, done.error
    stopped = wait_for_run(broke, timeout=60, connection=r)
    assert stopped.status == "stopped" and "usage limit" in stopped.error and stopped.turns == 0
    resume(broke, connection=r)
    assert wait_for_run(broke, timeout=60, connection=r).status == "completed", "resumable once the limit is raised"


def test_repeated_model_errors_stop_the_run_resumably(r, pool, model):
    model.set_scripts(
        {"down": [{"error": {"status": 500, "type": "api_error", "message": "boom", "times": 3}, "text": "back"}]}
    )
    pool.start(1, AGENTPOOL_MODEL_RETRIES="2")
    run_id = enqueue_run("pool_agents:budgeted", script_task("down"), connection=r)
    stopped = wait_for_run(run_id, timeout=60, connection=r)
    assert stopped.status == "stopped" and "failed 3 times in a row" in stopped.error
    resume(run_id, connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"


def test_a_checkpoint_written_by_schema_version_1_migrates_and_resumes(r, pool, model):
    golden = json.loads((ROOT / "tests" / "golden" / "run_v1.json").read_text())
    run_id = golden["run_id"]
    keys = RunKeys.of(run_id)
    raw = lambda s: base64.b64decode(s)
    r.hset(keys.run, mapping={k: raw(v) for k, v in golden["header"].items()})
    r.rpush(keys.messages, *[raw(m) for m in golden["messages"]])
    r.hset(keys.ledger, mapping={k: raw(v) for k, v in golden["ledger"].items()})
    assert r.hget(keys.run, "v") == b"1"
    r.zadd("ap:runs:watch", {run_id: 0})  # as if its worker died long ago: the reaper takes it over
    model.set_scripts({"golden": [{}, {"text": "Told the team."}]})

    pool.start(1)
    done = wait_for_run(run_id, timeout=60, connection=r)
    assert done.status == "completed", done.error
    assert done.turns == 2 and done.result == "Told the team."
    assert done.usage["input_tokens"] >= 412, "v1 usage carried over"
    assert r.hget(keys.run, "v") == str(SCHEMA_VERSION).encode(), "rewritten in the current version"
    tools = [e["tool"] for e in pool.effects()]
    assert tools.count("read_notes") == 1, "the started read tool re-ran"
    assert tools.count("send_email") == 1, "the email that never started was sent once"
    assert_valid_conversation(done.messages)


def test_watch_follows_a_run_to_its_end(r, pool, model):
    model.set_scripts(
        {
            "meeting": [
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}], "delay": 0.3},
                {"text": "done", "delay": 0.3},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)
    out = pool.cli("watch", run_id)
    assert out.returncode == 0, out.stderr
    assert "tool_started" in out.stdout and "read_notes" in out.stdout
    assert f"run {run_id} completed after 2 turns" in out.stdout


# 8 s: long enough that a loaded machine still reads the TTL before the run is gone (2 s was not).
@pytest.mark.parametrize("retention, expires", [("8", True), ("0", False)])
def test_finished_runs_expire_after_the_retention(r, pool, model, retention, expires):
    pool.start(1, AGENTPOOL_RETENTION_SECONDS=retention)
    run_id = enqueue_run("pool_agents:support", script_task("none"), connection=r)
    model.set_scripts({"none": [{"text": "hi"}]})
    wait_for_run(run_id, timeout=60, connection=r)
    ttl = r.ttl(RunKeys.of(run_id).run)
    assert (0 < ttl <= int(retention)) if expires else ttl == -1
    if expires:  # and the worker's reaper drops it from the run index once it is gone
        deadline = time.monotonic() + 60
        while r.zscore(RUNS, run_id) is not None:
            assert time.monotonic() < deadline, ("an expired run stays in the index", r.exists(RunKeys.of(run_id).run))
            time.sleep(0.1)
        assert r.exists(RunKeys.of(run_id).run) == 0


@contextmanager
def dashboard_in_process(r):
    """The dashboard's real HTTP server on a free loopback port, in this process."""
    server = make_server(r, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()

    def post(path: str, raw: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.server_address[1]}{path}",
            data=raw,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            with err:
                return err.code, json.loads(err.read())

    try:
        yield post
    finally:
        server.shutdown()
        server.server_close()


LOOP = [{"tool_calls": [{"name": "read_notes", "input": {"topic": str(i)}}]} for i in range(4)] + [{"text": "finished"}]


def test_a_resume_that_cannot_help_is_refused_with_what_is_needed(r, pool, model):
    model.set_scripts({"loop": LOOP})
    pool.start(1)
    by_turns = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_turns=2)
    by_tokens = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_total_tokens=300)
    by_cost = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_cost_usd=0.001)
    stopped = {run_id: wait_for_run(run_id, timeout=60, connection=r) for run_id in (by_turns, by_tokens, by_cost)}
    assert all(run.status == "stopped" for run in stopped.values()), stopped

    with pytest.raises(ResumeRefused, match=r"the run has used 2 of max_turns=2; resume with add_turns>=1"):
        resume(by_turns, connection=r)
    out = pool.cli("resume", by_turns)
    assert out.returncode == 1 and "resume with add_turns>=1" in out.stderr, out
    with dashboard_in_process(r) as post:
        status, doc = post(f"/api/runs/{by_turns}/resume", b"{}")
    assert status == 409 and "add_turns>=1" in doc["error"], (status, doc)

    used = stopped[by_tokens].total_tokens
    with pytest.raises(ResumeRefused, match=rf"used {used} of max_total_tokens=300 tokens.*add_tokens>={used - 299}"):
        resume(by_tokens, add_tokens=used - 300, connection=r)  # one short
    with pytest.raises(ResumeRefused, match=r"max_cost_usd=0.001; resume with add_usd>=0.0\d+"):
        resume(by_cost, add_usd=1e-9, connection=r)

    for run_id, run in stopped.items():  # refused: nothing changed
        after = get_run(run_id, connection=r)
        assert (after.status, after.limits, after.turns) == ("stopped", run.limits, run.turns)

    needed = resume_needs(r, by_cost)["add_usd"]
    assert resume(by_turns, add_turns=1, connection=r).status == "running"
    assert resume(by_tokens, add_tokens=used - 299, connection=r).status == "running"
    assert resume(by_cost, add_usd=needed, connection=r).status == "running"
    assert wait_for_run(by_turns, timeout=60, connection=r).turns == 3, "exactly one more turn"
    assert wait_for_run(by_tokens, timeout=60, connection=r).turns > stopped[by_tokens].turns
    assert wait_for_run(by_cost, timeout=60, connection=r).turns > stopped[by_cost].turns


NOT_A_LIMIT = [math.nan, math.inf, True]


def test_nan_infinity_and_bools_are_refused_on_every_way_a_limit_is_set(r, pool, model):
    for value in NOT_A_LIMIT:
        for name in ("max_turns", "max_total_tokens", "max_cost_usd"):
            with pytest.raises(InvalidLimit, match=name):
                enqueue_run("pool_agents:budgeted", "task", connection=r, **{name: value})
    assert r.zcard("ap:runs") == 0 and turn_queue(r).count == 0, "a refused enqueue writes nothing"
    for flag, value in (("--max-cost-usd", "inf"), ("--max-total-tokens", "nan"), ("--max-turns", "1.5")):
        out = pool.cli("enqueue", "pool_agents:budgeted", "task", flag, value)
        assert out.returncode == 2 and flag in out.stderr and "Traceback" not in out.stderr, out

    model.set_scripts({"loop": LOOP})
    pool.start(1)
    run_id = enqueue_run("pool_agents:budgeted", script_task("loop"), connection=r, max_cost_usd=0.001)
    stopped = wait_for_run(run_id, timeout=60, connection=r)
    assert stopped.status == "stopped"
    for value in NOT_A_LIMIT:
        for name in ("add_turns", "add_tokens", "add_usd"):
            with pytest.raises(InvalidLimit, match=name):
                resume(run_id, connection=r, **{name: value})
    for flag in ("--add-usd", "--add-tokens", "--add-turns"):
        for value in ("nan", "inf", "-1"):
            out = pool.cli("resume", run_id, flag, value)
            assert out.returncode == 2 and flag in out.stderr and "Traceback" not in out.stderr, out
    with dashboard_in_process(r) as post:
        for body in (
            b'{"add_usd": NaN}',
            b'{"add_turns": Infinity}',
            b'{"add_tokens": -Infinity}',
            b'{"add_usd": true}',
        ):
            status, doc = post(f"/api/runs/{run_id}/resume", body)
            assert status == 400 and "must be" in doc["error"], (body, status, doc)
    after = get_run(run_id, connection=r)
    assert (after.status, after.limits) == ("stopped", stopped.limits), "every refusal left the run as it was"

    # A NaN an older version let into the record is replaced by the next resume, not added to.
    r.hset(RunKeys.of(run_id).run, "limits", pack({**stopped.limits, "extra_usd": math.nan}))
    assert resume(run_id, add_usd=1.0, connection=r).limits["extra_usd"] == 1.0


def test_a_call_whose_input_can_never_run_is_refused_without_asking_anyone(r, pool, model):
    """Nobody is asked to approve what cannot run: input that fails the tool's schema is answered with its
    validation error at once, and the run never waits for a person."""
    model.set_scripts({"bad": [{"tool_calls": [{"name": "deploy", "input": {"version": 7}}]}, {"text": "fixed"}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("bad"), connection=r)
    done = wait_for_run(run_id, timeout=60, connection=r)
    assert done.status == "completed", done.error
    result = _tool_result(done, "deploy")
    assert result["is_error"] and "version" in result["content"], result
    statuses = [e.get("status") for _, e in read_events(r, run_id) if e["kind"] == "status"]
    assert "waiting_approval" not in statuses, statuses
    assert not r.exists(RunKeys.of(run_id).approvals), "no request for a decision was written"
    assert "deploy" not in [e["tool"] for e in pool.effects()]
