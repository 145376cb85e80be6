"""End-to-end runs through real RQ worker processes, the real anthropic client and the scripted model."""

from __future__ import annotations

import json
import subprocess
import sys

from agentpool import cancel_run, enqueue_run, get_run, wait_for_run
from agentpool.runtime.jobs import stage_turn

from conftest import ROOT, assert_valid_conversation, script_task

MEETING = [
    {"text": "Let me read the notes.", "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {
        "tool_calls": [
            {"name": "create_ticket", "input": {"title": "Changelog", "body": "Ana writes it"}},
            {
                "name": "send_email",
                "input": {"to": "team@example.com", "subject": "Release Friday", "body": "See ticket."},
            },
        ]
    },
    {"text": "The release ships Friday; a ticket is open and the team is told."},
]


def test_run_completes_with_tools_counters_and_a_valid_conversation(r, pool, model):
    model.set_scripts({"meeting": MEETING})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)

    assert run.status == "completed", run.error
    assert run.turns == 3
    assert run.result == "The release ships Friday; a ticket is open and the team is told."
    assert run.pending == []
    assert_valid_conversation(run.messages)
    assert [m["role"] for m in run.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    # parallel tool use: both results in one user message, in tool_use order
    second_results = run.messages[4]["content"]
    assert [b["type"] for b in second_results] == ["tool_result", "tool_result"]
    assert second_results[0]["content"].startswith("ticket ")
    assert second_results[1]["content"] == "email to team@example.com sent"
    prompt_tokens = (
        run.usage["input_tokens"] + run.usage["cache_read_input_tokens"] + run.usage["cache_creation_input_tokens"]
    )
    assert prompt_tokens > 0 and run.usage["output_tokens"] > 0
    assert sorted(e["tool"] for e in pool.effects()) == ["create_ticket", "read_notes", "send_email"]
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_stale_job_for_an_old_turn_exits_without_side_effects(r, pool, model):
    model.set_scripts({"meeting": MEETING})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)
    done = wait_for_run(run_id, timeout=60, connection=r)
    requests_before = model.stats()["requests"]

    with r.pipeline(transaction=True) as pipe:  # a human re-enqueues turn 1 by hand
        pipe.multi()
        stage_turn(pipe, r, run_id, 1, attempt=7)
        pipe.execute()
    rerun = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)  # a fresh run behind it
    wait_for_run(rerun, timeout=60, connection=r)

    after = get_run(run_id, connection=r)
    assert after.messages == done.messages and after.turns == done.turns
    assert model.stats()["requests"] - requests_before == 3  # only the new run called the model
    assert sum(1 for e in pool.effects() if e["run"] == run_id) == 3


def test_bad_tool_calls_become_is_error_results_and_the_run_goes_on(r, pool, model):
    model.set_scripts(
        {
            "bad": [
                {
                    "tool_calls": [
                        {"name": "read_notes", "input": {"topic": 5, "extra": True}},
                        {"name": "flaky_lookup", "input": {"item": "boom"}},
                        {"name": "hanging_lookup", "input": {"item": "x"}},
                        {"name": "odd_result", "input": {"item": "x"}},
                    ]
                },
                {"text": "I could not finish."},
            ]
        }
    )
    pool.start(1)
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("bad"), connection=r), timeout=60, connection=r)

    assert run.status == "completed", run.error
    results = run.messages[2]["content"]
    assert all(b["is_error"] for b in results), results
    text = [b["content"] for b in results]
    assert "invalid input for read_notes" in text[0] and "extra" in text[0]
    assert "RuntimeError: the lookup service is down" in text[1]
    assert "timed out after 0.5 s" in text[2]
    assert "cannot be sent to the model" in text[3]
    assert not any(e["tool"] == "read_notes" for e in pool.effects()), "invalid input must not reach the tool"
    assert_valid_conversation(run.messages)


def test_stop_reasons(r, pool, model):
    model.set_scripts(
        {
            "paused": [{"text": "Searching...", "stop_reason": "pause_turn"}, {"text": " Found it."}],
            "cut": [{"text": "A long answ", "stop_reason": "max_tokens"}, {"text": "er."}],
            "cut_tool": [
                {
                    "text": "Sending",
                    "tool_calls": [{"name": "send_email", "input": {"to": "a@b.c", "subject": "x", "body": "y"}}],
                    "stop_reason": "max_tokens",
                },
                {"text": "Gave up on the email."},
            ],
            "refused": [{"text": "I can't help with that.", "stop_reason": "refusal"}],
            "overflow": [{"text": "...", "stop_reason": "model_context_window_exceeded"}],
            "stopseq": [{"text": "Answer", "stop_reason": "stop_sequence"}],
        }
    )
    pool.start(2)
    ids = {
        name: enqueue_run("pool_agents:support", script_task(name), connection=r)
        for name in ("paused", "cut", "cut_tool", "refused", "overflow", "stopseq")
    }
    runs = {name: wait_for_run(i, timeout=60, connection=r) for name, i in ids.items()}

    assert (runs["paused"].status, runs["paused"].result, runs["paused"].turns) == (
        "completed",
        "Searching... Found it.",
        2,
    )
    assert (runs["cut"].status, runs["cut"].result) == ("completed", "A long answer.")
    assert runs["cut_tool"].status == "completed"
    truncated = runs["cut_tool"].messages[2]["content"][0]
    assert truncated["is_error"] and "cut off by max_tokens" in truncated["content"]
    assert not any(e["tool"] == "send_email" for e in pool.effects()), "a truncated tool_use must not run"
    assert runs["refused"].status == "failed" and "refusal" in runs["refused"].error
    # Out of context with compaction off: stopped, resumable, with the way on (tests/test_long_runs.py resumes one).
    assert runs["overflow"].status == "stopped" and "context window" in runs["overflow"].error
    assert "Agent(compaction=True)" in runs["overflow"].error and "resume" in runs["overflow"].error
    assert (runs["stopseq"].status, runs["stopseq"].result) == ("completed", "Answer")
    for run in runs.values():
        assert_valid_conversation(run.messages)
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]


def test_a_reply_cut_after_whitespace_or_inside_its_thinking_goes_on_and_is_stored_as_returned(r, pool, model):
    # The API refuses a continuation ending in whitespace or in a thinking block: the request is
    # trimmed as it is sent, the history keeps the reply byte for byte (the prompt cache reads it).
    model.set_scripts(
        {
            "cut": [{"text": "A long answer ", "stop_reason": "max_tokens"}, {"text": "goes on."}],
            "paused": [{"text": "Searching...\n\n", "stop_reason": "pause_turn"}, {"text": "Found it."}],
            "thought": [{"thinking": "First I", "stop_reason": "max_tokens"}, {"text": "Thought it through."}],
        }
    )
    pool.start(1)
    ids = {
        name: enqueue_run("pool_agents:support", script_task(name), connection=r)
        for name in ("cut", "paused", "thought")
    }
    runs = {name: wait_for_run(i, timeout=60, connection=r) for name, i in ids.items()}

    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    assert (runs["cut"].status, runs["cut"].result) == ("completed", "A long answer goes on."), runs["cut"].error
    assert runs["cut"].messages[1]["content"][0]["text"] == "A long answer "
    assert (runs["paused"].status, runs["paused"].result) == ("completed", "Searching...\n\nFound it.")
    assert runs["paused"].messages[1]["content"][0]["text"] == "Searching...\n\n"
    assert runs["thought"].status == "completed", runs["thought"].error
    assert [b["type"] for b in runs["thought"].messages[1]["content"]] == ["thinking"]
    assert runs["thought"].messages[1]["content"][0]["signature"]
    assert runs["thought"].result == "Thought it through."
    for run in runs.values():
        assert run.turns == 2
        assert_valid_conversation(run.messages)


def test_max_turns_stops_the_run_with_a_reason(r, pool, model):
    model.set_scripts(
        {"loop": [{"tool_calls": [{"name": "read_notes", "input": {"topic": str(i)}}]} for i in range(10)]}
    )
    pool.start(1)
    run = wait_for_run(
        enqueue_run("pool_agents:support", script_task("loop"), connection=r, max_turns=3), timeout=60, connection=r
    )
    assert run.status == "stopped"
    assert run.turns == 3
    assert "max_turns=3" in run.error
    assert_valid_conversation(run.messages)


def test_cancel_ends_a_run_and_its_turn_commits_nothing_more(r, pool, model):
    model.set_scripts(
        {
            "slow": [
                {"tool_calls": [{"name": "slow_read", "input": {"seconds": 2}}]},
                {"tool_calls": [{"name": "send_email", "input": {"to": "a@b.c", "subject": "late", "body": "x"}}]},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    pool.wait_for_effect("slow_read")
    assert cancel_run(run_id, connection=r) == "running"
    run = wait_for_run(run_id, timeout=30, connection=r)
    # The slow tool finishes and its turn ends without committing: waited for by the job's end, as a
    # few seconds' sleep may not be enough on a loaded machine (the check below would then prove nothing).
    pool.wait_for_log(lambda line: f"Job OK ({run_id}-t0000" in line, "saying the cancelled turn's job ended")
    after = get_run(run_id, connection=r)
    assert after.status == "cancelled"
    assert after.messages == run.messages and len(after.messages) == 2
    assert not any(e["tool"] == "send_email" for e in pool.effects())


def test_model_api_400_fails_the_run_with_its_message_and_keeps_history(r, pool, model):
    model.set_scripts(
        {
            "bad_request": [
                {
                    "error": {
                        "status": 400,
                        "type": "invalid_request_error",
                        # (not "prompt is too long": that one stops the run, resumable; tests/test_long_runs.py)
                        "message": "max_tokens: 100000 > 64000, the maximum allowed for this model",
                    }
                }
            ]
        }
    )
    pool.start(1)
    run = wait_for_run(
        enqueue_run("pool_agents:support", script_task("bad_request"), connection=r), timeout=60, connection=r
    )
    assert run.status == "failed"
    assert "max_tokens: 100000 > 64000" in run.error
    assert run.turns == 0 and len(run.messages) == 1


def test_transient_model_errors_are_retried_later_without_consuming_turns(r, pool, model):
    model.set_scripts(
        {
            "overloaded": [
                {
                    "error": {"status": 529, "type": "overloaded_error", "message": "Overloaded", "times": 2},
                    "text": "Fine now.",
                },
            ]
        }
    )
    pool.start(1, AGENTPOOL_MODEL_RETRIES="4")
    run = wait_for_run(
        enqueue_run("pool_agents:support", script_task("overloaded"), connection=r), timeout=60, connection=r
    )
    assert run.status == "completed", run.error
    assert run.turns == 1
    assert model.stats()["errors_injected"] == 2


def test_cli_enqueue_show_and_runs(r, pool, model, redis_server):
    model.set_scripts({"meeting": MEETING})
    pool.start(1)
    cli = [sys.executable, "-m", "agentpool"]
    env = pool.env
    out = subprocess.run(
        [*cli, "enqueue", "pool_agents:support", script_task("meeting"), "--wait"],
        env=env,
        cwd=str(ROOT / "tests"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.splitlines()[0].strip()
    assert run_id.startswith("r_") and "completed after 3 turns" in out.stdout

    shown = subprocess.run(
        [*cli, "show", run_id, "--json"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    doc = json.loads(shown.stdout)
    for field in ("id", "agent", "status", "turns", "messages", "pending", "usage", "result", "error"):
        assert field in doc
    assert doc["status"] == "completed" and len(doc["ledger"]) == 3

    table = subprocess.run([*cli, "runs"], env=env, capture_output=True, text=True, timeout=60, check=False).stdout
    assert run_id in table and "completed" in table
