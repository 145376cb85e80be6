"""Behaviour of agentpool.testing.scripted_model, driven through the real anthropic SDK over HTTP."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import pytest

from agentpool.testing.scripted_model import ScriptedModel, load_scripts

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "claude-sonnet-5-5"
TOOL_ID = re.compile(r"^toolu_[A-Za-z0-9]{24}$")
TOOLS = [
    {
        "name": "add",
        "description": "Add two numbers.",
        "input_schema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
    {
        "name": "lookup",
        "description": "Look a word up.",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
]

SCRIPTS: dict[str, list[dict]] = {
    "calc": [
        {"text": "Let me add those.", "tool_calls": [{"name": "add", "input": {"a": 1, "b": 2}}]},
        {"text": "The answer is 3."},
    ],
    "parallel": [
        {"tool_calls": [{"name": "add", "input": {"a": 1, "b": 1}}, {"name": "lookup", "input": {"word": "rq"}}]},
        {"text": "Both done."},
    ],
    "think": [
        {
            "thinking": "I need to add 1 and 2.",
            "text": "Adding.",
            "tool_calls": [{"name": "add", "input": {"a": 1, "b": 2}}],
        },
        {"text": "3"},
    ],
    "flaky": [
        {
            "error": {"status": 429, "type": "rate_limit_error", "message": "Slow down", "times": 2, "retry_after": 7},
            "text": "Finally.",
        },
    ],
    "overloaded": [
        {"error": {"status": 529, "type": "overloaded_error", "message": "Overloaded"}, "text": "ok"},
    ],
    "slow": [{"delay": 0.3, "text": "sorry for the wait"}],
    "typo": [{"tool_calls": [{"name": "add", "input": {"a": "one"}}]}],
    "custom_usage": [{"text": "x", "usage": {"output_tokens": 4096}, "stop_reason": "max_tokens"}],
    "cut_thinking": [{"thinking": "First I", "stop_reason": "max_tokens"}, {"text": "Go on."}],
    "cut_text": [{"thinking": "Easy.", "text": "The answer is ", "stop_reason": "max_tokens"}, {"text": "3."}],
    "default": [{"text": "default script here"}],
}
for _reason in (
    "end_turn",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "max_tokens",
    "refusal",
    "model_context_window_exceeded",
):
    SCRIPTS[f"stop_{_reason}"] = [{"text": f"stopping with {_reason}", "stop_reason": _reason}]


@pytest.fixture()
def model() -> Iterator[ScriptedModel]:
    m = ScriptedModel(copy.deepcopy(SCRIPTS)).start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture()
def client(model: ScriptedModel) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=model.base_url, api_key="test", max_retries=0)
    try:
        yield c
    finally:
        c.close()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def create(client: anthropic.Anthropic, messages: list[dict], **kwargs: Any) -> anthropic.types.Message:
    kwargs.setdefault("tools", TOOLS)
    return client.messages.create(model=MODEL, max_tokens=1024, messages=messages, **kwargs)


def as_assistant(message: anthropic.types.Message) -> dict:
    return {"role": "assistant", "content": message.to_dict(mode="json")["content"]}


def results_for(message: anthropic.types.Message, output: str = "ok") -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": output}
            for b in message.content
            if b.type == "tool_use"
        ],
    }


def raw_post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict, Any]:
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def raw_get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ---- the happy path -------------------------------------------------------------------------------


def test_tool_use_then_end_turn_round_trip(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    messages = [user("[script:calc] what is 1 + 2?")]
    first = create(client, messages)

    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.id.startswith("msg_")
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "Let me add those."
    call = first.content[1]
    assert TOOL_ID.match(call.id) and call.name == "add" and call.input == {"a": 1, "b": 2}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    assert first.usage.cache_creation_input_tokens == 0 and first.usage.cache_read_input_tokens == 0

    # Stored as JSON and sent back, the response is a valid assistant message.
    stored = json.loads(json.dumps(as_assistant(first)))
    messages += [stored, results_for(first, "3")]
    second = create(client, messages)
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == "The answer is 3."
    assert second.usage.input_tokens > first.usage.input_tokens

    # to_param() is accepted as well.
    assert create(client, [messages[0], first.to_param(), results_for(first)]).content[0].text == "The answer is 3."

    # Past the end of the script: "Done.".
    messages += [as_assistant(second), user("thanks")]
    third = create(client, messages)
    assert third.stop_reason == "end_turn" and third.content[0].text == "Done."

    stats = model.stats()
    assert stats["requests"] == 4 and stats["responses"] == 4 and stats["rejected"] == 0
    assert stats["by_script"] == {"calc": 4}


def test_same_request_gets_same_step_with_fresh_ids(client: anthropic.Anthropic) -> None:
    messages = [user("[script:calc] what is 1 + 2?")]
    a, b = create(client, messages), create(client, messages)
    assert a.content[0].text == b.content[0].text == "Let me add those."
    assert a.content[1].id != b.content[1].id and a.id != b.id


def test_parallel_tool_calls(client: anthropic.Anthropic) -> None:
    messages = [user("[script:parallel] do two things")]
    first = create(client, messages)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert [c.name for c in calls] == ["add", "lookup"]
    assert len({c.id for c in calls}) == 2 and all(TOOL_ID.match(c.id) for c in calls)
    second = create(client, messages + [as_assistant(first), results_for(first)])
    assert second.content[0].text == "Both done." and second.stop_reason == "end_turn"


@pytest.mark.parametrize(
    "reason",
    ["end_turn", "stop_sequence", "tool_use", "pause_turn", "max_tokens", "refusal", "model_context_window_exceeded"],
)
def test_each_stop_reason(client: anthropic.Anthropic, reason: str) -> None:
    message = create(client, [user(f"[script:stop_{reason}] go")])
    assert message.stop_reason == reason
    assert message.stop_sequence == ("###" if reason == "stop_sequence" else None)
    assert message.content[0].text == f"stopping with {reason}"


def test_pause_turn_continuation_with_last_assistant_message(client: anthropic.Anthropic) -> None:
    messages = [user("[script:stop_pause_turn] go")]
    paused = create(client, messages)
    # Continuing a paused turn sends the assistant content back as the last message.
    resumed = create(client, messages + [as_assistant(paused)])
    assert resumed.content[0].text == "Done."


def test_a_continuation_may_not_end_in_whitespace_or_in_a_thinking_block(client: anthropic.Anthropic) -> None:
    messages = [user("[script:cut_thinking] go")]
    thought = as_assistant(create(client, messages))
    assert [b["type"] for b in thought["content"]] == ["thinking"]
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages + [thought])
    assert info.value.body["error"]["message"] == (
        "messages.1: The final block in an assistant message cannot be `thinking`."
    )
    assert create(client, messages + [thought, user("Well?")]).content[0].text == "Go on."  # earlier: accepted

    messages = [user("[script:cut_text] 1 + 2?")]
    cut = as_assistant(create(client, messages))
    with pytest.raises(anthropic.BadRequestError, match="final assistant content cannot end with trailing whitespace"):
        create(client, messages + [cut])
    stripped = {"role": "assistant", "content": [cut["content"][0], {"type": "text", "text": "The answer is"}]}
    assert create(client, messages + [stripped]).content[0].text == "3."


def test_default_script_and_builtin_default() -> None:
    with (
        ScriptedModel({"default": [{"text": "default script here"}]}) as m,
        anthropic.Anthropic(base_url=m.base_url, api_key="k", max_retries=0) as c,
    ):
        assert create(c, [user("no marker")]).content[0].text == "default script here"
    with ScriptedModel() as m, anthropic.Anthropic(base_url=m.base_url, api_key="k", max_retries=0) as c:
        message = create(c, [user("no marker")], tools=anthropic.NOT_GIVEN)
        assert message.content[0].text == "Done." and message.stop_reason == "end_turn"
        assert m.stats()["by_script"] == {"default": 1}


def test_usage_override_and_delay(client: anthropic.Anthropic) -> None:
    assert create(client, [user("[script:custom_usage] x")]).usage.output_tokens == 4096
    started = time.monotonic()
    assert create(client, [user("[script:slow] x")]).content[0].text == "sorry for the wait"
    assert time.monotonic() - started >= 0.3


# ---- rejections -----------------------------------------------------------------------------------


def _tool_turn(client: anthropic.Anthropic, script: str = "parallel") -> tuple[list[dict], anthropic.types.Message]:
    messages = [user(f"[script:{script}] go")]
    first = create(client, messages)
    return messages + [as_assistant(first)], first


def test_missing_tool_result_rejected(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    messages, first = _tool_turn(client)
    ids = [b.id for b in first.content if b.type == "tool_use"]
    only_first = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": ids[0], "content": "ok"}]}
    expected = (
        f"messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: "
        f"{ids[1]}. Each `tool_use` block must have a corresponding `tool_result` block in the "
        f"next message."
    )
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages + [only_first])
    assert info.value.status_code == 400
    assert info.value.body["error"] == {"type": "invalid_request_error", "message": expected}
    assert info.value.body["request_id"].startswith("req_")
    assert info.value.request_id == info.value.body["request_id"]

    # Text before the results does not count as "immediately after".
    text_first = {"role": "user", "content": [{"type": "text", "text": "here you go"}] + results_for(first)["content"]}
    with pytest.raises(
        anthropic.BadRequestError, match=f"without `tool_result` blocks immediately after: {ids[0]}, {ids[1]}"
    ):
        create(client, messages + [text_first])

    # Nor does a plain user message, or ending on the tool_use.
    with pytest.raises(anthropic.BadRequestError, match="messages.1: `tool_use` ids were found"):
        create(client, messages + [user("what happened?")])
    with pytest.raises(anthropic.BadRequestError, match="messages.1: `tool_use` ids were found"):
        create(client, messages)

    stats = model.stats()
    assert stats["rejected"] == 4 and stats["rejections"][0] == expected


def test_unknown_tool_use_id_rejected(client: anthropic.Anthropic) -> None:
    messages, first = _tool_turn(client)
    results = results_for(first)
    results["content"].append({"type": "tool_result", "tool_use_id": "toolu_notarealid", "content": "x"})
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages + [results])
    assert info.value.body["error"]["message"] == (
        "messages.2.content.2: unexpected `tool_use_id` found in `tool_result` blocks: toolu_notarealid. "
        "Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
    )


def test_duplicate_tool_result_rejected(client: anthropic.Anthropic) -> None:
    messages, first = _tool_turn(client)
    results = results_for(first)
    results["content"].append(dict(results["content"][0]))
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages + [results])
    message = info.value.body["error"]["message"]
    assert message.startswith("messages.2.content.2: multiple `tool_result` blocks")
    assert results["content"][0]["tool_use_id"] in message


def test_null_key_from_model_dump_rejected(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    messages = [user("[script:calc] go")]
    first = create(client, messages)
    careless = {"role": "assistant", "content": [b.model_dump() for b in first.content]}
    assert careless["content"][0]["citations"] is None
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages + [careless, results_for(first)])
    assert info.value.body["error"]["message"] == "messages.1.content.0.citations: Input should be a valid list"
    assert model.stats()["rejections"][-1] == "messages.1.content.0.citations: Input should be a valid list"


def test_tool_use_naming_undefined_tool_rejected(client: anthropic.Anthropic) -> None:
    messages, first = _tool_turn(client, "calc")
    with pytest.raises(anthropic.BadRequestError, match="`add`, which is not defined in `tools`"):
        create(client, messages + [results_for(first)], tools=[TOOLS[1]])


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([{"role": "assistant", "content": "hi"}], 'first message must use the "user" role'),
        ([{"role": "system", "content": "hi"}], "messages.0.role: Input should be 'user' or 'assistant'"),
        ([{"role": "user", "content": [{"type": "video", "url": "x"}]}], "Input tag 'video'"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a", "colour": "red"}]}],
            "messages.0.content.0.text.colour: Extra inputs are not permitted",
        ),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello "}],
            "final assistant content cannot end with trailing whitespace",
        ),
    ],
)
def test_malformed_messages_rejected(client: anthropic.Anthropic, messages: list, fragment: str) -> None:
    with pytest.raises(anthropic.BadRequestError, match=re.escape(fragment)):
        create(client, messages)


def test_a_pdf_counts_by_its_pages_and_more_than_a_hundred_are_refused(client: anthropic.Anthropic) -> None:
    """As the API counts a PDF: by its pages (written plainly or packed into a compressed object stream),
    not by the size of its data; and a request holds at most 100 pages."""
    from test_long_runs import pdf_block

    def input_tokens(*blocks: dict) -> int:
        return create(
            client, [{"role": "user", "content": [*blocks, {"type": "text", "text": "Read it."}]}]
        ).usage.input_tokens

    one = input_tokens(pdf_block(1))
    assert input_tokens(pdf_block(1, packed=True, noise=200_000)) == one, "a page costs the same, however large"
    assert input_tokens(pdf_block(3, packed=True)) == input_tokens(pdf_block(3)) == one + 2 * 2_400
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 100 PDF pages may be provided"):
        input_tokens(pdf_block(60), pdf_block(41, packed=True))


def test_bad_tools_rejected(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="tools.0.custom.input_schema: Field required"):
        create(client, [user("hi")], tools=[{"name": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="input_schema.type: Input should be 'object'"):
        create(client, [user("hi")], tools=[{"name": "x", "input_schema": {"type": "string"}}])
    with pytest.raises(anthropic.BadRequestError, match="Tool names must be unique"):
        create(client, [user("hi")], tools=[TOOLS[0], TOOLS[0]])
    # Server tools need no input_schema.
    assert create(client, [user("hi")], tools=[{"type": "web_search_20250305", "name": "web_search"}])


def test_unknown_script_is_a_test_bug(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="unknown script 'nope'"):
        create(client, [user("[script:nope] go")])


def test_a_script_may_call_a_tool_the_request_does_not_offer(client: anthropic.Anthropic) -> None:
    """A model calling a tool it was not given is a mistake a test must be able to script: the reply holds
    the tool_use, and the next request may send it back with its (error) result. A tool_use the client
    names after a tool it dropped, or forges, is still refused."""
    messages = [user("[script:calc] go")]
    first = create(client, messages, tools=[TOOLS[1]])
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert (call.name, call.input, first.stop_reason) == ("add", {"a": 1, "b": 2}, "tool_use")
    assert TOOL_ID.match(call.id)
    answered = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "no such tool", "is_error": True}],
    }
    second = create(client, messages + [as_assistant(first), answered], tools=[TOOLS[1]])
    assert second.content[0].text == "The answer is 3."

    forged = as_assistant(first)
    forged["content"][-1]["id"] = call.id[:-1] + ("x" if call.id[-1] != "x" else "y")
    answered["content"][0]["tool_use_id"] = forged["content"][-1]["id"]
    with pytest.raises(anthropic.BadRequestError, match="`add`, which is not defined in `tools`"):
        create(client, messages + [forged, answered], tools=[TOOLS[1]])
    renamed = as_assistant(first)
    renamed["content"][-1]["name"] = "subtract"  # the id was made for `add`
    answered["content"][0]["tool_use_id"] = call.id
    with pytest.raises(anthropic.BadRequestError, match="`subtract`, which is not defined in `tools`"):
        create(client, messages + [renamed, answered], tools=[TOOLS[1]])


def test_a_script_may_give_a_tool_input_its_schema_refuses(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    """Input of the wrong type, or missing a field, is the model's mistake too: it is sent as scripted
    (checking it is the client's job); only an input that is not an object, which the API never sends,
    is a script error."""
    (call,) = create(client, [user("[script:typo] go")]).content
    assert (call.name, call.input) == ("add", {"a": "one"})
    with pytest.raises(ValueError, match=r"x.0.tool_calls.0: must be \{'name': str, 'input': dict\}"):
        model.set_scripts({"x": [{"tool_calls": [{"name": "add", "input": "one"}]}]})


def test_top_level_validation_over_raw_http(model: ScriptedModel) -> None:
    url = model.base_url + "/v1/messages"
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    status, _, body = raw_post(url, {"model": MODEL, "messages": [user("hi")]}, headers)
    assert status == 400 and body["error"]["message"] == "max_tokens: Field required"
    status, _, body = raw_post(url, {"model": MODEL, "max_tokens": 0, "messages": [user("hi")]}, headers)
    assert status == 400 and "greater than or equal to 1" in body["error"]["message"]
    status, _, body = raw_post(url, {"model": MODEL, "max_tokens": 5, "messages": []}, headers)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, _, body = raw_post(url, b"{not json", headers)
    assert status == 400 and body["type"] == "error"
    status, _, body = raw_post(
        url, {"model": MODEL, "max_tokens": 5, "messages": [user("hi")], "whatever_new_param": 1}, headers
    )
    assert status == 200 and body["content"] == [{"type": "text", "text": "default script here"}]


# ---- injected errors ------------------------------------------------------------------------------


def test_injected_429_twice_then_success(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    messages = [user("[script:flaky] go")]
    for _ in range(2):
        with pytest.raises(anthropic.RateLimitError) as info:
            create(client, messages)
        err = info.value
        assert err.status_code == 429 and err.type == "rate_limit_error"
        assert err.body == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": "Slow down"},
            "request_id": err.request_id,
        }
        assert err.response.headers["retry-after"] == "7"
        assert err.response.headers["x-should-retry"] == "false"
    assert create(client, messages).content[0].text == "Finally."
    stats = model.stats()
    assert stats["errors_injected"] == 2 and stats["rejected"] == 0 and stats["responses"] == 1

    # A different conversation on the same script has its own counter.
    with pytest.raises(anthropic.RateLimitError):
        create(client, [user("[script:flaky] another conversation")])


def test_injected_errors_are_not_retried_by_the_sdk(model: ScriptedModel) -> None:
    # Even with SDK retries on (and a retry-after of 7 s), x-should-retry: false surfaces the error at once.
    with (
        anthropic.Anthropic(base_url=model.base_url, api_key="k", max_retries=3) as c,
        pytest.raises(anthropic.RateLimitError),
    ):
        create(c, [user("[script:flaky] go")])
    # One request reached the server (counted, not timed: a retry would have been a second one).
    assert model.stats()["errors_injected"] == 1 and model.stats()["requests"] == 1


def test_injected_529_is_overloaded_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.InternalServerError) as info:
        create(client, [user("[script:overloaded] go")])
    assert isinstance(info.value, anthropic.OverloadedError)
    assert info.value.status_code == 529 and info.value.type == "overloaded_error"
    assert create(client, [user("[script:overloaded] go")]).content[0].text == "ok"


def test_reset_forgets_error_counters(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    with pytest.raises(anthropic.OverloadedError):
        create(client, [user("[script:overloaded] go")])
    status, _, body = raw_post(model.base_url + "/_reset", {})
    assert status == 200 and body == {"ok": True}
    assert model.stats()["errors_injected"] == 0 and model.stats()["requests"] == 0
    with pytest.raises(anthropic.OverloadedError):
        create(client, [user("[script:overloaded] go")])


# ---- thinking -------------------------------------------------------------------------------------


def test_thinking_block_round_trips_and_tampering_is_rejected(client: anthropic.Anthropic) -> None:
    messages = [user("[script:think] 1 + 2?")]
    first = create(client, messages)
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == "I need to add 1 and 2." and first.content[0].signature

    assistant = as_assistant(first)
    assert create(client, messages + [assistant, results_for(first)]).content[0].text == "3"

    tampered = copy.deepcopy(assistant)
    tampered["content"][0]["thinking"] = "I need to add 1 and 3."
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages + [tampered, results_for(first)])
    assert info.value.body["error"]["message"] == "messages.1.content.0: Invalid `signature` in `thinking` block"

    forged = copy.deepcopy(assistant)
    forged["content"][0]["signature"] = "AAAA" + forged["content"][0]["signature"][4:]
    with pytest.raises(anthropic.BadRequestError, match="Invalid `signature`"):
        create(client, messages + [forged, results_for(first)])


# ---- prompt caching -------------------------------------------------------------------------------


def _cached_request(big: str) -> dict:
    return {
        "system": [{"type": "text", "text": big, "cache_control": {"type": "ephemeral"}}],
        "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}, TOOLS[1]],
    }


def test_cache_read_on_second_identical_request() -> None:
    big = "You are a careful agent. " * 40  # ~250 tokens by the //4 estimate
    with (
        ScriptedModel(cache_min_tokens=100) as m,
        anthropic.Anthropic(base_url=m.base_url, api_key="k", max_retries=0) as c,
    ):
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "question one", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
                ],
            }
        ]
        first = c.messages.create(model=MODEL, max_tokens=100, messages=messages, **_cached_request(big))
        second = c.messages.create(model=MODEL, max_tokens=100, messages=messages, **_cached_request(big))

        assert first.usage.cache_creation_input_tokens > 100 and first.usage.cache_read_input_tokens == 0
        assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
        assert second.usage.cache_creation_input_tokens == 0
        total = lambda u: u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
        assert total(first.usage) == total(second.usage)

        # Same system prompt, new question: the system prefix is read, the new tail is written.
        other = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "question two " * 5, "cache_control": {"type": "ephemeral"}}],
            }
        ]
        third = c.messages.create(model=MODEL, max_tokens=100, messages=other, **_cached_request(big))
        assert 0 < third.usage.cache_read_input_tokens < second.usage.cache_read_input_tokens
        assert third.usage.cache_creation_input_tokens > 0

        # A different model does not share the cache.
        fourth = c.messages.create(model="claude-opus-5-5", max_tokens=100, messages=messages, **_cached_request(big))
        assert fourth.usage.cache_read_input_tokens == 0


def test_short_prefix_is_silently_not_cached(client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "short", "cache_control": {"type": "ephemeral"}}]
    for _ in range(2):
        message = create(client, [user("hi")], system=system)
        assert message.usage.cache_creation_input_tokens == 0 and message.usage.cache_read_input_tokens == 0


def test_more_than_four_breakpoints_rejected(client: anthropic.Anthropic) -> None:
    marked = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"part {i}", "cache_control": marked} for i in range(3)]
    tools = [{**t, "cache_control": marked} for t in TOOLS]
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, [user("hi")], system=system, tools=tools)
    assert info.value.body["error"]["message"] == "A maximum of 4 blocks with cache_control may be provided. Found 5."


# ---- auth and plumbing ----------------------------------------------------------------------------


def test_missing_auth_is_401(model: ScriptedModel) -> None:
    no_auth = anthropic.Anthropic(
        base_url=model.base_url, api_key="unused", max_retries=0, default_headers={"Authorization": anthropic.Omit()}
    )
    with no_auth, pytest.raises(anthropic.AuthenticationError) as info:
        create(no_auth, [user("hi")])
    assert info.value.status_code == 401 and info.value.type == "authentication_error"

    status, _, _body = raw_post(
        model.base_url + "/v1/messages",
        {"model": MODEL, "max_tokens": 5, "messages": [user("hi")]},
        {"x-api-key": "sk-secret-value", "anthropic-version": "2023-06-01"},
    )
    assert status == 200
    assert "sk-secret-value" not in json.dumps(model.stats())


def test_stats_scripts_and_unknown_paths(model: ScriptedModel) -> None:
    status, body = raw_get(model.base_url + "/_stats")
    assert status == 200 and body == model.stats()
    assert set(body) == {
        "requests",
        "responses",
        "rejected",
        "errors_injected",
        "rejections",
        "by_script",
        "streams",
        "streams_cut",
        "compactions",
        "summaries",
        "request_bytes",
        "rate_limited",
        "tokens",
    }

    status, _, body = raw_post(model.base_url + "/_scripts", {"only": [{"text": "replaced"}]})
    assert status == 200 and body["scripts"] == ["only"]
    with anthropic.Anthropic(base_url=model.base_url, api_key="k", max_retries=0) as c:
        served = create(c, [user("[script:only] go")])
        assert served.content[0].text == "replaced"
        with pytest.raises(anthropic.BadRequestError, match="unknown script 'calc'"):
            create(c, [user("[script:calc] go")])
    kinds = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert model.stats()["tokens"] == {kind: getattr(served.usage, kind) or 0 for kind in kinds}
    assert model.stats()["tokens"]["output_tokens"] > 0

    status, _, body = raw_post(model.base_url + "/_scripts", {"bad": [{"txet": "typo"}]})
    assert status == 400 and "unknown step keys" in body["error"]["message"]

    status, body = raw_get(model.base_url + "/nowhere")
    assert status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error"
    status, body = raw_get(model.base_url + "/v1/messages")
    assert status == 405 and body["type"] == "error"


def test_set_scripts_validates(model: ScriptedModel) -> None:
    with pytest.raises(ValueError):
        model.set_scripts({"x": [{"stop_reason": "because"}]})
    with pytest.raises(ValueError):
        ScriptedModel({"x": "not a list"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_main_runs_as_a_subprocess(tmp_path: Path) -> None:
    scripts_file = tmp_path / "scripts.json"
    scripts_file.write_text(json.dumps({"hello": [{"text": "hi from the subprocess"}]}))
    assert load_scripts(str(scripts_file)) == {"hello": [{"text": "hi from the subprocess"}]}
    port = _free_port()
    env = dict(os.environ)
    with subprocess.Popen(
        [sys.executable, "-m", "agentpool.testing.scripted_model", "--port", str(port), "--scripts", str(scripts_file)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:  # the context manager closes the pipes and waits for the process
        try:
            line = proc.stdout.readline()
            assert line.strip() == f"listening on http://127.0.0.1:{port}"
            with anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0) as c:
                assert create(c, [user("[script:hello] hi")]).content[0].text == "hi from the subprocess"
            proc.terminate()
            assert proc.wait(timeout=10) == 0
            assert proc.stderr.read() == ""  # quiet: no per-request logging
        finally:
            if proc.poll() is None:
                proc.kill()


def test_concurrent_requests_are_counted_exactly(model: ScriptedModel) -> None:
    with (
        anthropic.Anthropic(base_url=model.base_url, api_key="k", max_retries=0) as c,
        ThreadPoolExecutor(max_workers=8) as pool,
    ):
        replies = list(pool.map(lambda i: create(c, [user(f"[script:slow] request {i}")]), range(16)))
    assert all(r.content[0].text == "sorry for the wait" for r in replies)
    stats = model.stats()
    assert stats["requests"] == stats["responses"] == 16 and stats["by_script"] == {"slow": 16}


def test_a_request_cut_off_by_its_dying_client_is_not_a_rejection(
    client: anthropic.Anthropic, model: ScriptedModel
) -> None:
    """A SIGKILLed worker leaves a request whose body never arrived whole: the real API never sees it, so
    it must not show up as a request the model rejected (tests assert ``rejected == 0``)."""
    host, port = model.base_url.split("//")[1].rstrip("/").split(":")
    for sent in (b"", b'{"model": "claude'):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: k\r\nanthropic-version: 2023-06-01\r\n"
                b"content-type: application/json\r\ncontent-length: 500\r\n\r\n" + sent
            )
        deadline = time.monotonic() + 1  # the server's thread for that connection has seen it end by then
        while time.monotonic() < deadline and model.stats()["requests"] == 0 and model.stats()["rejected"] == 0:
            time.sleep(0.05)
    client.messages.create(model="claude-opus-5-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    stats = model.stats()
    assert stats["rejected"] == 0, stats["rejections"]
    assert stats["requests"] == 1


def test_a_client_resetting_its_keep_alive_connection_prints_no_traceback(
    client: anthropic.Anthropic, model: ScriptedModel, capfd: pytest.CaptureFixture[str]
) -> None:
    """A SIGKILLed worker resets its pooled connection (RST) while the server waits for its next request."""
    import struct

    host, port = model.base_url.split("//")[1].rstrip("/").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"GET /_stats HTTP/1.1\r\nHost: x\r\n\r\n")
    s.recv(65536)  # answered; the server now waits on this connection for the next request
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # an RST, as the kernel sends for a killed process's connection with unread data
    time.sleep(0.3)
    client.messages.create(model="claude-opus-5-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert "Traceback" not in capfd.readouterr().err
