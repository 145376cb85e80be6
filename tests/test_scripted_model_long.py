"""The scripted model's streaming, server-side compaction, context window and summaries, driven through
the real anthropic SDK over HTTP (its stream helpers, its beta endpoint, its error classes)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import pytest

from agentpool.agent import SUMMARY_PROMPT
from agentpool.testing.scripted_model import ScriptedModel
from agentpool.testing.scripted_model.compaction import SUMMARY_REQUEST_PREFIX

MODEL = "claude-sonnet-5-5"
TOOLS = [
    {
        "name": "fetch",
        "description": "Fetch a page.",
        "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}},
    }
]
COMPACT = ["compact-2026-01-12"]
BIG = "x" * 60_000  # ~15k tokens at the scripted model's 4 characters a token


def edits(trigger: int = 50_000, **extra: Any) -> dict[str, Any]:
    return {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": trigger}, **extra}]}


SCRIPTS: dict[str, list[dict]] = {
    "rich": [
        {
            "thinking": "The user wants a page.",
            "text": "Fetching it now, one moment.",
            "tool_calls": [{"name": "fetch", "input": {"url": "https://example.com/a"}}],
            "stream": {"chunk": 5, "pings": 3},
        },
        {"text": "Here it is."},
    ],
    "cut_error": [{"text": "a long answer that is cut", "stream": {"chunk": 4, "cut": {"after": 5, "times": 2}}}],
    "cut_drop": [{"text": "a long answer that is dropped", "stream": {"chunk": 4, "cut": {"after": 5, "how": "drop"}}}],
    "cut_stall": [{"text": "slow", "stream": {"cut": {"after": 3, "how": "stall", "seconds": 2}}}],
    "long": [{"tool_calls": [{"name": "fetch", "input": {"url": f"https://example.com/{i}"}}]} for i in range(6)]
    + [{"text": "all fetched"}],
    "summarized": [
        {"tool_calls": [{"name": "fetch", "input": {"url": "https://example.com/1"}}]},
        {"tool_calls": [{"name": "fetch", "input": {"url": "https://example.com/2"}}]},
        {
            "text": "done after the summary",
            # A summary asked for before this step (after two replies) fails once, then says this too.
            "summary": {"error": {"status": 529, "type": "overloaded_error"}, "text": "The pages are fetched."},
        },
    ],
}


@pytest.fixture()
def model() -> Iterator[ScriptedModel]:
    m = ScriptedModel(copy.deepcopy(SCRIPTS), context_window=120_000).start()
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


def results(content: list[dict], output: str = "ok") -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": output}
            for b in content
            if b["type"] == "tool_use"
        ],
    }


def stream(client: anthropic.Anthropic, messages: list[dict], **kw: Any) -> tuple[dict, list[str]]:
    """The final message as JSON and the raw event types, through the SDK's stream helper."""
    kw.setdefault("tools", TOOLS)
    api: Any = client.beta.messages if "betas" in kw else client.messages
    with api.stream(model=kw.pop("model", MODEL), max_tokens=2048, messages=messages, **kw) as s:
        kinds = [event.type for event in s]
        return s.get_final_message().to_dict(mode="json"), kinds


def create(client: anthropic.Anthropic, messages: list[dict], **kw: Any) -> dict:
    kw.setdefault("tools", TOOLS)
    api: Any = client.beta.messages if "betas" in kw else client.messages
    return api.create(model=kw.pop("model", MODEL), max_tokens=2048, messages=messages, **kw).to_dict(mode="json")


# -- streaming ---------------------------------------------------------------------------------------


def test_a_stream_parses_into_the_message_a_create_returns(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    messages = [user("[script:rich] fetch a page")]
    streamed, kinds = stream(client, messages)
    created = create(client, messages)

    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b["type"] for b in streamed["content"]] == ["thinking", "text", "tool_use"]
    for a, b in zip(streamed["content"], created["content"]):
        assert {k: v for k, v in a.items() if k != "id"} == {k: v for k, v in b.items() if k != "id"}
    assert streamed["usage"]["input_tokens"] == created["usage"]["input_tokens"]
    assert streamed["usage"]["output_tokens"] == created["usage"]["output_tokens"] > 1
    assert streamed["stop_reason"] == "tool_use"
    texts = [t for _, t in model.delta_times()]
    assert "".join(texts) == "Fetching it now, one moment." and len(texts) == 6, "5-character text deltas"
    # The streamed message goes back as is: its signed thinking block is accepted.
    answer, _ = stream(
        client, [*messages, {"role": "assistant", "content": streamed["content"]}, results(streamed["content"])]
    )
    assert answer["content"] == [{"type": "text", "text": "Here it is."}]
    assert model.stats()["rejected"] == 0 and model.stats()["streams"] == 2


def test_an_error_event_after_the_200_cuts_the_stream_then_it_completes(client: anthropic.Anthropic) -> None:
    messages = [user("[script:cut_error] go")]
    for _ in range(2):
        with pytest.raises(anthropic.APIStatusError) as cut:
            stream(client, messages)
        assert cut.value.status_code == 200 and cut.value.body["error"]["type"] == "overloaded_error"
    final, _ = stream(client, messages)
    assert final["content"][0]["text"] == "a long answer that is cut"


def test_a_connection_dropped_midway_and_a_silent_stream(client: anthropic.Anthropic, model: ScriptedModel) -> None:
    # The SDK raises the transport's error as it is, or (2.17 and later) wrapped with it as the cause.
    with pytest.raises((httpx2.RemoteProtocolError, anthropic.APIConnectionError)) as dropped:
        stream(client, [user("[script:cut_drop] go")])
    assert isinstance(dropped.value.__cause__ or dropped.value, httpx2.RemoteProtocolError)
    impatient = anthropic.Anthropic(base_url=model.base_url, api_key="k", max_retries=0, timeout=0.5)
    with impatient, pytest.raises((httpx2.ReadTimeout, anthropic.APITimeoutError)) as silent:
        stream(impatient, [user("[script:cut_stall] go")])
    assert isinstance(silent.value.__cause__ or silent.value, httpx2.ReadTimeout)
    # Only the first stream of a step is cut (times: 1 by default).
    assert stream(client, [user("[script:cut_drop] go")])[0]["stop_reason"] == "end_turn"
    assert model.stats()["streams_cut"] == 2


def test_stream_options_are_validated(model: ScriptedModel) -> None:
    for bad in ({"chunk": 0}, {"cut": {"how": "explode"}}, {"speed": 1}):
        with pytest.raises(ValueError):
            model.set_scripts({"x": [{"text": "t", "stream": bad}]})


# -- server-side compaction ------------------------------------------------------------------------------


def test_compaction_needs_the_beta_a_valid_trigger_and_a_model_that_has_it(client: anthropic.Anthropic) -> None:
    messages = [user("[script:long] go")]
    with pytest.raises(anthropic.BadRequestError, match="context_management: Extra inputs are not permitted"):
        create(client, messages, extra_body={"context_management": edits()})
    with pytest.raises(anthropic.BadRequestError, match="greater than or equal to 50000"):
        create(client, messages, betas=COMPACT, context_management=edits(trigger=30_000))
    with pytest.raises(anthropic.BadRequestError, match="not supported on model `claude-haiku-4-5`"):
        create(client, messages, betas=COMPACT, context_management=edits(), model="claude-haiku-4-5")
    assert create(client, messages, betas=COMPACT, context_management=edits())["stop_reason"] == "tool_use"


def _grow(client: anthropic.Anthropic, messages: list[dict], turns: int, **kw: Any) -> tuple[list[dict], dict]:
    reply: dict = {}
    for _ in range(turns):
        reply, _ = stream(client, messages, **kw)
        messages = [*messages, {"role": "assistant", "content": reply["content"]}]
        if reply["stop_reason"] == "tool_use":
            messages.append(results(reply["content"], BIG))
    return messages, reply


def test_past_the_trigger_the_reply_starts_with_a_compaction_block_the_next_request_starts_from(
    client: anthropic.Anthropic, model: ScriptedModel
) -> None:
    kw = {"betas": COMPACT, "context_management": edits()}
    messages, reply = _grow(client, [user("[script:long] fetch them all")], 5, **kw)
    assert [b["type"] for b in reply["content"]] == ["compaction", "tool_use"], "the 5th request passed 50k tokens"
    block = reply["content"][0]
    assert "[script:long] [turns:4]" in block["content"] and block["signature"] and block["tool_changes"] == []
    compacting, sampling = reply["usage"]["iterations"]
    assert compacting["type"] == "compaction" and compacting["input_tokens"] > 50_000
    assert sampling["type"] == "message" and reply["usage"]["input_tokens"] == sampling["input_tokens"] < 1_000

    # The next request starts from the compaction block; the script goes on where it was.
    window = [messages[-2], messages[-1]]
    after, _ = stream(client, window, **kw)
    assert after["content"][0]["input"] == {"url": "https://example.com/5"}
    assert after["usage"]["input_tokens"] < 20_000, "input tokens count only what the window holds"

    # The whole history, or an edited block, is refused with the API's error codes.
    refusals = {
        "compaction_block_misplaced": messages,
        "compaction_content_mismatch": [
            {"role": "assistant", "content": [{**block, "content": block["content"] + "!"}, *reply["content"][1:]]},
            window[1],
        ],
        "compaction_signature_invalid": [
            {"role": "assistant", "content": [{**block, "signature": "AAAA"}, *reply["content"][1:]]},
            window[1],
        ],
        "compaction_tool_changes_mismatch": [
            {"role": "assistant", "content": [{**block, "tool_changes": None}, *reply["content"][1:]]},
            window[1],
        ],
    }
    for code, bad in refusals.items():
        with pytest.raises(anthropic.BadRequestError) as refused:
            create(client, bad, **kw)
        assert refused.value.error_code == code
    two = [window[0], window[1], {"role": "assistant", "content": [block]}, user("again")]
    with pytest.raises(anthropic.BadRequestError) as ambiguous:
        create(client, two, **kw)
    assert ambiguous.value.error_code == "compaction_block_ambiguous"
    with pytest.raises(anthropic.BadRequestError, match="Input tag 'compaction'"):
        create(client, window)  # without the beta the block type does not exist
    failed = {**block, "content": None}  # a failed compaction: a no-op wherever it is
    assert create(
        client, [messages[0], {"role": "assistant", "content": [failed, *messages[1]["content"]]}, messages[2]], **kw
    )
    assert model.stats()["compactions"] == 1


def test_pause_after_compaction_returns_the_block_alone_and_the_next_request_goes_on(
    client: anthropic.Anthropic,
) -> None:
    kw = {"betas": COMPACT, "context_management": edits(pause_after_compaction=True)}
    _, reply = _grow(client, [user("[script:long] fetch them all")], 5, **kw)
    assert [b["type"] for b in reply["content"]] == ["compaction"] and reply["stop_reason"] == "compaction"
    resumed, _ = stream(client, [{"role": "assistant", "content": reply["content"]}], **kw)
    assert resumed["content"][0]["input"] == {"url": "https://example.com/4"}, "the paused step, not the next"


# -- the context window and summaries ---------------------------------------------------------------------


def test_past_the_window_a_prompt_is_refused_and_a_reply_is_cut(model: ScriptedModel) -> None:
    with (
        ScriptedModel({"talk": [{"text": "word " * 400}]}, context_window=2_000) as small,
        anthropic.Anthropic(base_url=small.base_url, api_key="k", max_retries=0) as c,
    ):
        reply = create(c, [user("[script:talk] " + "y" * 6_000)])
        assert reply["stop_reason"] == "model_context_window_exceeded"
        assert reply["usage"]["input_tokens"] + reply["usage"]["output_tokens"] <= 2_000
        assert not reply["content"][0]["text"].endswith(" "), "sent back to continue, it must be valid"
        with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):  # valid, but full
            create(c, [user("[script:talk] " + "y" * 6_000), {"role": "assistant", "content": reply["content"]}])
        with pytest.raises(anthropic.BadRequestError, match="prompt is too long: .* tokens > 2000 maximum"):
            create(c, [user("[script:talk] " + "y" * 9_000)])


def test_a_summary_request_is_answered_with_a_summary_the_script_goes_on_from(client: anthropic.Anthropic) -> None:
    assert SUMMARY_PROMPT.startswith(SUMMARY_REQUEST_PREFIX), "agentpool's summary prompt is what the model knows"
    messages, _ = _grow(client, [user("[script:summarized] go")], 2)
    ask = [
        *messages[:-1],
        {"role": "user", "content": [*messages[-1]["content"], {"type": "text", "text": SUMMARY_PROMPT}]},
    ]
    with pytest.raises(anthropic.InternalServerError):  # the step's summary error, once
        create(client, ask)
    summary = create(client, ask)["content"][0]["text"]
    assert "[script:summarized] [turns:2]" in summary and "The pages are fetched." in summary
    after, _ = stream(client, [user("Summary of the earlier part:\n" + summary)])
    assert after["content"][0]["text"] == "done after the summary"


def test_input_tokens_grow_with_the_request(client: anthropic.Anthropic) -> None:
    messages = [user("[script:long] go")]
    seen = []
    for _ in range(3):
        reply, _ = stream(client, messages)
        seen.append(reply["usage"]["input_tokens"])
        messages += [{"role": "assistant", "content": reply["content"]}, results(reply["content"], "z" * 4_000)]
    assert seen[0] < seen[1] < seen[2] and seen[2] - seen[1] > 900


def test_clear_tool_uses_is_checked_and_clears_old_results(client: anthropic.Anthropic) -> None:
    clear = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 2},
        "keep": {"type": "tool_uses", "value": 1},
    }
    with pytest.raises(anthropic.BadRequestError, match="requires the `anthropic-beta: context-management-2025-06-27`"):
        create(client, [user("[script:long] go")], betas=COMPACT, context_management={"edits": [clear]})
    messages, _ = _grow(client, [user("[script:long] go")], 3)
    plain = create(client, messages)
    cleared = create(client, messages, betas=["context-management-2025-06-27"], context_management={"edits": [clear]})
    assert cleared["usage"]["input_tokens"] < plain["usage"]["input_tokens"] - 20_000
    assert cleared["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 2
    assert json.dumps(cleared)  # serializable as returned
