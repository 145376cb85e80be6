"""What the Messages API demands of a conversation, checked independently of any server."""

from __future__ import annotations

from typing import Any


def assert_valid_conversation(messages: list[dict[str, Any]]) -> None:
    """Every tool_use has exactly one tool_result, first in the very next user message, in order; no
    stray results. ``run.messages`` of any run must pass, whatever crashed on the way."""
    assert messages and messages[0]["role"] == "user"
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
