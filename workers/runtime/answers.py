"""A run's answer: the stop reasons after which the model has finished, and the text it answered.

Apart from the turn runtime so that what reads a run's answer (``fork_run``, ``send_message``) need
not import the model adapter and the anthropic SDK with it.
"""

from __future__ import annotations

from typing import Any

FINISHED_STOPS = ("end_turn", "stop_sequence")


def trailing_text(messages: list[dict[str, Any]]) -> str:
    """The text of the assistant messages after the last user message (a paused or cut-off answer
    continues over several)."""
    parts: list[str] = []
    for message in reversed(messages):
        if message["role"] != "assistant":
            break
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        parts.insert(0, "".join(b.get("text", "") for b in blocks if b.get("type") == "text"))
    return "".join(parts)
