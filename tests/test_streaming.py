"""Streamed model calls in real workers: a stream cut midway (an `error` event after the 200, a dropped
connection, a silence past AGENTPOOL_MODEL_TIMEOUT, a call past AGENTPOOL_MODEL_CALL_TIMEOUT) is
retried later like a 529, its partial output never committed and the tokens it reported counted once;
workers SIGKILLed mid-stream and right after that count."""

from __future__ import annotations

from collections import Counter

import pytest

from agentpool import enqueue_run, wait_for_run
from agentpool.store.events import read as read_events
from agentpool.store.stats import SPEND_EVENTS

from conftest import assert_valid_conversation, script_task

USAGE = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def spent_by_events(r, run_id: str) -> dict[str, int]:
    """Every call paid for, as the run's events report it (counted outside the run's header)."""
    total: Counter = Counter()
    for _id, event in read_events(r, run_id):
        if event["kind"] in SPEND_EVENTS:
            for name in USAGE:
                total[name] += int(event.get(name, 0))
    return {name: total[name] for name in USAGE}


def events_of(r, run_id: str, kind: str) -> list[dict[str, str]]:
    return [e for _, e in read_events(r, run_id) if e["kind"] == kind]


def cut(how: str, **extra: object) -> dict:
    return {"chunk": 3, "cut": {"after": 6, "how": how, **extra}}


CUT_STREAMS = [
    {
        "text": "Reading the notes first.",
        "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}],
        "stream": cut("error", type="overloaded_error"),
    },
    {
        "thinking": "The notes say Friday.",
        "text": "Now the email.",
        "tool_calls": [{"name": "send_email", "input": {"to": "team@example.com", "subject": "Fri", "body": "Ship"}}],
        "stream": cut("drop"),
    },
    {"text": "Sent. The release ships Friday.", "stream": cut("stall", seconds=3)},
]


def test_streams_cut_midway_are_retried_and_their_tokens_counted_once(r, pool, model):
    model.set_scripts({"cuts": CUT_STREAMS})
    pool.start(1, AGENTPOOL_MODEL_TIMEOUT="1")  # the stall outlasts it
    run_id = enqueue_run("pool_agents:support", script_task("cuts"), connection=r)
    run = wait_for_run(run_id, timeout=90, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    assert run.turns == 3 and run.result == "Sent. The release ships Friday."
    assert model.stats()["streams_cut"] == 3 and model.stats()["rejected"] == 0
    cuts = events_of(r, run_id, "model_cut")
    assert [e["error_type"] for e in cuts] == ["overloaded_error", "connection", "timeout"]
    assert [e["error_type"] for e in events_of(r, run_id, "model_error")] == [e["error_type"] for e in cuts]
    prompt = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert all(sum(int(e.get(k, 0)) for k in prompt) > 0 for e in cuts), "message_start reported the prompt's tokens"
    assert run.usage == spent_by_events(r, run_id), "every call paid for counted once, cut ones included"
    for name in prompt:
        committed = sum(int(e.get(name, 0)) for e in events_of(r, run_id, "model_responded"))
        assert run.usage[name] == committed + sum(int(e.get(name, 0)) for e in cuts), name
    # Nothing of a cut stream was committed: the conversation is exactly the three complete replies.
    assert [b["type"] for b in run.messages[3]["content"]] == ["thinking", "text", "tool_use"]
    assert Counter(e["tool"] for e in pool.effects()) == {"read_notes": 1, "send_email": 1}
    assert_valid_conversation(run.messages)


def test_a_stream_refused_midway_fails_the_run_with_its_tokens_counted(r, pool, model):
    """An ``error`` event of a final type after the 200 fails the run; the tokens ``message_start``
    reported were billed, and counted (they were lost before)."""
    refused = cut("error", type="invalid_request_error", message="Bad request", times=5)
    model.set_scripts({"refused": [{"text": "word " * 40, "stream": refused}]})
    pool.start(1)
    run = wait_for_run(
        enqueue_run("pool_agents:support", script_task("refused"), connection=r), timeout=60, connection=r
    )
    assert run.status == "failed" and "invalid_request_error" in run.error, (run.status, run.error)
    (counted,) = events_of(r, run.id, "model_cut")
    prompt = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert counted["error_type"] == "rejected" and sum(int(counted.get(k, 0)) for k in prompt) > 0, counted
    assert run.usage == spent_by_events(r, run.id) and sum(run.usage[k] for k in prompt) > 0


def test_a_call_past_the_whole_call_cap_is_cut_and_the_run_stops_after_the_retries(r, pool, model):
    model.set_scripts({"slow": [{"text": "word " * 40, "stream": {"chunk": 5, "interval": 0.1}}]})
    pool.start(1, AGENTPOOL_MODEL_CALL_TIMEOUT="1", AGENTPOOL_MODEL_RETRIES="1")
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("slow"), connection=r), timeout=60, connection=r)
    assert run.status == "stopped" and "AGENTPOOL_MODEL_CALL_TIMEOUT" in run.error, run.error
    assert run.turns == 0 and len(run.messages) == 1
    assert len(events_of(r, run.id, "model_cut")) == 2 and run.usage == spent_by_events(r, run.id)


def test_a_call_that_only_pings_is_cut_at_the_whole_call_cap(r, pool, model):
    """The API's pings keep a slow call alive (no idle timeout fires), so the whole call's cap must see
    them: a call whose stream only pinged went on for as long as the pings did."""
    pinging = {"how": "pings", "after": 2, "seconds": 40, "times": 2}
    model.set_scripts({"stuck": [{"text": "never mind", "stream": {"cut": pinging}}]})
    pool.start(1, AGENTPOOL_MODEL_CALL_TIMEOUT="1", AGENTPOOL_MODEL_RETRIES="1")
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("stuck"), connection=r), timeout=30, connection=r)
    assert run.status == "stopped" and "AGENTPOOL_MODEL_CALL_TIMEOUT" in run.error, (run.status, run.error)
    assert len(events_of(r, run.id, "model_cut")) == 2


def test_a_tool_call_cut_by_max_tokens_mid_input_is_answered_as_not_run(r, pool, model):
    """The stream ends the tool's input JSON midway: kept as far as it parses, answered as not run, and
    the run goes on. It used to be an unreadable event: the call retried until the run stopped."""
    email = {"name": "send_email", "input": {"to": "a@b.c", "subject": "report", "body": "A long body " * 20}}
    model.set_scripts(
        {"cut": [{"text": "Sending", "tool_calls": [email], "stop_reason": "max_tokens"}, {"text": "ok"}]}
    )
    pool.start(1)
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("cut"), connection=r), timeout=60, connection=r)
    assert (run.status, run.result) == ("completed", "ok"), (run.status, run.error, pool.logs())
    cut = next(b for b in run.messages[1]["content"] if b["type"] == "tool_use")
    assert cut["input"]["to"] == "a@b.c" and cut["input"] != email["input"], "kept as far as it parsed"
    answered = run.messages[2]["content"][0]
    assert answered["is_error"] and "cut off by max_tokens" in answered["content"]
    assert not any(e["tool"] == "send_email" for e in pool.effects()) and not events_of(r, run.id, "model_cut")
    assert_valid_conversation(run.messages)


def test_without_streaming_a_call_is_one_create(r, pool, model):
    model.set_scripts({"plain": [{"tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]}, {"text": "ok"}]})
    pool.start(1, AGENTPOOL_MODEL_STREAMING="0")
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("plain"), connection=r), timeout=60, connection=r)
    assert run.status == "completed" and run.result == "ok"
    assert model.stats()["streams"] == 0 and model.stats()["responses"] == 2


@pytest.mark.crash
@pytest.mark.parametrize("point", ["mid_stream", "after_partial_spend"])
def test_a_worker_killed_mid_stream_or_after_counting_a_cut_stream(point, r, pool, model):
    # Every step's first stream is cut by an error event: each turn counts a cut spend, then its
    # retry completes. mid_stream kills the horse at the first delta of a turn's first call;
    # after_partial_spend right after the cut stream's spend is counted.
    steps = [{**{k: v for k, v in step.items() if k != "stream"}, "stream": cut("error")} for step in CUT_STREAMS]
    model.set_scripts({"cuts": steps})
    pool.start(2, AGENTPOOL_FAULTS=point)
    run_id = enqueue_run("pool_agents:support", script_task("cuts"), connection=r)
    run = wait_for_run(run_id, timeout=120, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    assert run.turns == 3 and run.result == "Sent. The release ships Friday."
    kills = len(list(pool.tmp.glob(f"fault-{point}-{run_id}-*")))
    assert kills == 3, f"the fault point fired in every turn, fired {kills}"
    assert run.usage == spent_by_events(r, run_id)
    cuts = events_of(r, run_id, "model_cut")
    if point == "after_partial_spend":
        assert len(cuts) == 3, "each cut stream counted once, though its worker died right after"
    assert Counter(e["tool"] for e in pool.effects()) == {"read_notes": 1, "send_email": 1}
    assert model.stats()["rejected"] == 0, model.stats()["rejections"]
    assert_valid_conversation(run.messages)


def _without_ids(message: dict) -> dict:
    return {**message, "content": [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]}


@pytest.mark.parametrize("compaction", [False, True])
def test_a_streamed_reply_is_the_message_a_create_returns_field_for_field(model, monkeypatch, compaction):
    """The worker reads a stream's events itself (agentpool.runtime.reply_stream): what it accumulates
    must be the message the API's non-streaming answer is, block for block (thinking with its signature,
    text, a tool's input joined from its JSON deltas, a compaction block), and its usage."""
    from agentpool import Agent, Compaction, tool
    from agentpool.runtime import model as adapter

    @tool(effect="read")
    def fetch(url: str) -> str:
        """Fetch a page."""
        return url

    step = {
        "thinking": "The user wants a page.",
        "text": "Fetching it now, one moment.",
        "tool_calls": [{"name": "fetch", "input": {"url": "https://example.com/a", "tries": [1, 2]}}],
        "stream": {"chunk": 3, "pings": 2},
    }
    model.set_scripts({"rich": [step]})
    agent = Agent(
        model="claude-sonnet-5-5",
        tools=[fetch],
        compaction=Compaction(trigger=50_000, server_side=True) if compaction else None,
    )
    messages = [{"role": "user", "content": "[script:rich] " + "x" * (240_000 if compaction else 10)}]
    monkeypatch.setenv("ANTHROPIC_BASE_URL", model.base_url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    replies = {}
    for streaming in ("1", "0"):
        monkeypatch.setenv("AGENTPOOL_MODEL_STREAMING", streaming)
        adapter.reset_client()
        replies[streaming] = adapter.call_model(agent, messages)
    adapter.reset_client()
    streamed, created = replies["1"], replies["0"]
    assert _without_ids(streamed.message) == _without_ids(created.message)
    assert [b["type"] for b in streamed.message["content"]][-3:] == ["thinking", "text", "tool_use"]
    assert streamed.message["content"][-1]["input"] == {"url": "https://example.com/a", "tries": [1, 2]}
    # The second call reads the prompt cache the first one wrote: the same input, counted differently.
    prompt = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert sum(streamed.usage[k] for k in prompt) == sum(created.usage[k] for k in prompt) > 0
    assert streamed.usage["output_tokens"] == created.usage["output_tokens"] > 0
    assert streamed.stop_reason == created.stop_reason == "tool_use"
    assert streamed.compacted == created.compacted == compaction
