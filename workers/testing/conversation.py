"""What the Messages API demands of a conversation, checked without a server: the scripted model's own
rules (``scripted_model.validation.check_conversation``), so the kit and the server cannot drift."""

from __future__ import annotations

from typing import Any

from agentpool.testing.scripted_model.common import ApiError
from agentpool.testing.scripted_model.validation import check_conversation


def assert_valid_conversation(messages: list[dict[str, Any]]) -> None:
    """Fail with the API's words if the Messages API would refuse ``messages`` in a request: message
    and block shapes, where each block may stand, and every tool_use answered by exactly one
    tool_result, first in the very next user message, with no tool_result for a tool_use that message
    does not follow. Then agentpool's own order: it starts with the user's task, and the results come
    in tool_use order. ``run.messages`` of any run must pass, whatever crashed on the way."""
    assert messages and messages[0]["role"] == "user", "a run's conversation starts with the user's task"
    try:
        check_conversation(messages)
    except ApiError as exc:
        raise AssertionError(f"the Messages API would refuse this conversation: {exc.message}") from None
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] != "assistant" or isinstance(content, str):
            continue
        ids = [b["id"] for b in content if b["type"] == "tool_use"]
        if not ids:
            continue
        assert i + 1 < len(messages), f"messages[{i}] has tool_use {ids} and nothing after it"
        following = messages[i + 1]
        assert following["role"] == "user", f"messages[{i + 1}] should carry the tool results"
        results = [b for b in following["content"] if b["type"] == "tool_result"]
        assert [b["tool_use_id"] for b in results] == ids, f"results {results} do not answer {ids} in order"
        assert following["content"][: len(ids)] == results, "tool_result blocks must come first"
