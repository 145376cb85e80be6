"""How many input tokens a model call may count, before it is made: what its rate-limit reservation
takes (``agentpool.runtime.ratelimit``) and what the compaction trigger weighs. Cautious, and corrected
once the reply says what was counted. No import beyond the standard library and ``documents``: an app's
``enqueue_run`` estimates its run's first call with it (see ``first_call``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentpool.runtime.documents import pdf_block_data, pdf_pages

if TYPE_CHECKING:
    from agentpool.agent import Agent

CHARS_PER_TOKEN = 3  # cautious: JSON and code run ~3 characters a token; the reservation is corrected after
# The most one image costs the model: the API scales a larger one down (about 1,600 tokens on most
# models, 4,784 on those with high-resolution vision).
IMAGE_TOKENS = 4_800
# The most a PDF page costs: its text (1,500 to 3,000 tokens, the PDF guide says; about 2,400 measured
# for a page of prose) and an image of the page (about 1,600).
PDF_PAGE_TOKENS = 3_000 + 1_600


def estimate_input(agent: Agent, messages: list[dict[str, Any]], last_reply: Mapping[str, Any] | None) -> int:
    """Input tokens the call may count: the last call's context and what came after it, or (no last
    call, or a summary) the whole request."""
    if last_reply and last_reply.get("context_tokens"):
        added = after_last_reply(messages)
        return int(last_reply["context_tokens"]) + estimate_tokens(added)
    tools = [t.to_param() for t in agent.tools]
    return estimate_tokens([agent.system or "", tools, messages])


def estimate_tokens(value: Any) -> int:
    """Input tokens ``value`` (messages, a system prompt, tool definitions) may count: text at
    ``CHARS_PER_TOKEN``, an image at the most one costs (``IMAGE_TOKENS``) and a PDF at the most its
    pages cost (``PDF_PAGE_TOKENS`` each) wherever they stand (a message, a tool result). Their base64
    data is no measure of them: a photo's or a report's megabyte counted as text would reserve a whole
    minute's budget for one call, and pass any compaction trigger. A PDF whose pages cannot be counted
    (``agentpool.runtime.documents``) counts as its text."""
    counted = 0

    def without_media(item: Any) -> Any:
        nonlocal counted
        if isinstance(item, dict):
            if item.get("type") == "image":
                counted += IMAGE_TOKENS
                return None
            if (data := pdf_block_data(item)) is not None and (pages := pdf_pages(data)):
                counted += pages * PDF_PAGE_TOKENS
                return None
            return {k: without_media(v) for k, v in item.items()}
        if isinstance(item, list):
            return [without_media(v) for v in item]
        return item

    text = json.dumps(without_media(value), ensure_ascii=False, default=str)
    return max(1, len(text) // CHARS_PER_TOKEN + counted)


def after_last_reply(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages after the last assistant one: what a call sends beyond the last call's context."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return messages[i + 1 :]
    return messages


def first_call(agent: Agent, task: str) -> tuple[str, int, int]:
    """A run's first call as its job carries it (model, input tokens, output tokens), estimated as the
    turn will estimate it: its lease reserves it, as it does for every later turn (``next_call``)."""
    messages = [{"role": "user", "content": task}]
    return agent.model, estimate_input(agent, messages, None), int(agent.max_tokens)


def call_field(call: tuple[str, int, int]) -> str:
    """A call as an event field keeps it (``next_call`` of a completed run's ``status`` event): input
    tokens, output tokens and model, the model last (``call_from_field`` reads it back)."""
    model, tokens_in, tokens_out = call
    return f"{tokens_in} {tokens_out} {model}"


def call_from_field(text: str | None, added: list[dict[str, Any]]) -> tuple[str, int, int] | None:
    """The call ``call_field`` recorded, with the input tokens of the messages ``added`` since; None when
    nothing was recorded (or what was is not a call: the event is not trusted to be well formed)."""
    parts = (text or "").split(" ", 2)
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()) or not parts[2]:
        return None
    return parts[2], int(parts[0]) + estimate_tokens(added), int(parts[1])
