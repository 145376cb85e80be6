"""The scripted model enforces rate limits as the Messages API does, seen through the real anthropic SDK."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator

import anthropic
import pytest

from agentpool.testing.scripted_model import RateLimits, ScriptedModel

MODEL = "claude-sonnet-5-5"
RATE_HEADERS = [
    f"anthropic-ratelimit-{dim}-{part}"
    for dim in ("requests", "input-tokens", "output-tokens", "tokens")
    for part in ("limit", "remaining", "reset")
]


@pytest.fixture()
def model() -> Iterator[ScriptedModel]:
    m = ScriptedModel({"default": [{"text": "ok"}]}, cache_min_tokens=64).start()
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


def call(client: anthropic.Anthropic, text: str = "hello", max_tokens: int = 100, **kw: object) -> object:
    return client.messages.with_raw_response.create(
        model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": text}], **kw
    )


def test_every_reply_carries_the_rate_limit_headers_as_the_api_names_them(
    model: ScriptedModel, client: anthropic.Anthropic
) -> None:
    model.set_rate_limits(RateLimits(rpm=10, itpm=10_000, otpm=5_000))
    raw = call(client)
    for name in RATE_HEADERS:
        assert name in raw.headers, name
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "10"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "9"
    assert raw.headers["anthropic-ratelimit-input-tokens-limit"] == "10000"
    # The output estimate (max_tokens) is held while the reply is made: the headers go out before it ends.
    assert raw.headers["anthropic-ratelimit-output-tokens-remaining"] == "4900"
    reset = dt.datetime.fromisoformat(raw.headers["anthropic-ratelimit-requests-reset"])
    assert reset.tzinfo is not None and reset >= dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
    streamed = client.messages.with_streaming_response.create(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with streamed as response:
        assert response.headers["anthropic-ratelimit-requests-remaining"] == "8"
        response.read()


def test_requests_beyond_the_limit_get_a_429_rate_limit_error_with_retry_after(
    model: ScriptedModel, client: anthropic.Anthropic
) -> None:
    model.set_rate_limits(RateLimits(rpm=3, minute=30))
    for _ in range(3):
        call(client)
    with pytest.raises(anthropic.RateLimitError) as caught:
        call(client)
    err = caught.value
    assert err.body["error"]["type"] == "rate_limit_error"
    assert int(err.response.headers["retry-after"]) >= 1
    assert err.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert model.stats()["rate_limited"] == 1
    assert model.stats()["responses"] == 3


def test_the_bucket_refills_continuously_in_scaled_time(model: ScriptedModel, client: anthropic.Anthropic) -> None:
    model.set_rate_limits(RateLimits(rpm=2, minute=1.0))  # 2 a second
    call(client)
    call(client)
    with pytest.raises(anthropic.RateLimitError):
        call(client)
    deadline = time.monotonic() + 10
    while True:  # waits for the refill, however slow the machine: the assertion is that one comes
        try:
            call(client)
            break
        except anthropic.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_input_tokens_count_uncached_input_and_cache_writes_but_not_cache_reads(
    model: ScriptedModel, client: anthropic.Anthropic
) -> None:
    big = "word " * 800  # ~1000 tokens, cached from the second call on
    system = [{"type": "text", "text": big, "cache_control": {"type": "ephemeral"}}]
    model.set_rate_limits(RateLimits(itpm=100_000))
    first = call(client, system=system)
    spent_first = 100_000 - int(first.headers["anthropic-ratelimit-input-tokens-remaining"])
    usage = first.parse().usage
    assert usage.cache_creation_input_tokens and spent_first >= usage.cache_creation_input_tokens
    second = call(client, system=system)
    usage = second.parse().usage
    assert usage.cache_read_input_tokens and usage.cache_read_input_tokens > 500
    remaining_after = int(second.headers["anthropic-ratelimit-input-tokens-remaining"])
    spent_second = int(first.headers["anthropic-ratelimit-input-tokens-remaining"]) - remaining_after
    # The cache read is free; only the uncached tail counts (the bucket refilled a little meanwhile).
    assert spent_second <= usage.input_tokens + usage.cache_creation_input_tokens


def test_max_tokens_is_held_on_admission_and_corrected_to_the_real_output(
    model: ScriptedModel, client: anthropic.Anthropic
) -> None:
    model.set_rate_limits(RateLimits(otpm=1000, minute=3600))  # no visible refill during the test
    call(client, max_tokens=900)
    # 900 were held while the reply was made, then all but the few "ok" took given back:
    raw = call(client, max_tokens=900)
    assert int(raw.headers["anthropic-ratelimit-output-tokens-remaining"]) < 1000 - 900
    with pytest.raises(anthropic.RateLimitError) as caught:
        call(client, max_tokens=995)  # more than is left now, though far more than any reply so far used
    assert "output tokens" in caught.value.body["error"]["message"]


def test_a_refused_request_does_not_write_the_prompt_cache(model: ScriptedModel, client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "word " * 800, "cache_control": {"type": "ephemeral"}}]
    model.set_rate_limits(RateLimits(rpm=1, minute=3600))
    call(client, text="first")
    with pytest.raises(anthropic.RateLimitError):
        call(client, system=system)
    model.set_rate_limits(None)
    usage = call(client, system=system).parse().usage
    assert usage.cache_read_input_tokens == 0 and usage.cache_creation_input_tokens


def test_no_limits_no_headers_and_bad_limits_are_refused(model: ScriptedModel, client: anthropic.Anthropic) -> None:
    raw = call(client)
    assert not [h for h in raw.headers if h.startswith("anthropic-ratelimit-")]
    for bad in ({"rpm": 0}, {"itpm": -5}, {"otpm": 1.5}, {"minute": float("nan")}):
        with pytest.raises(ValueError):
            RateLimits(**bad)  # type: ignore[arg-type]
