"""Running one tool: a timeout, exceptions and unserializable results become ``is_error`` outcomes."""

from __future__ import annotations

import contextvars
import json
import logging
import threading
from typing import Any

from agentpool.context import ToolCall, set_current_call
from agentpool.store.ledger import Outcome
from agentpool.tools import Tool

log = logging.getLogger("agentpool.tools")


def result_text(value: Any, limit: int) -> Outcome:
    if value is None:
        text = ""
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            return Outcome(
                f"the tool returned a {type(value).__name__}, which cannot be sent to the model: {exc}", True
            )
    if len(text) > limit:
        text = text[:limit] + f"\n[... cut: the result was {len(text)} characters, the limit is {limit}]"
    return Outcome(text, False)


def run_tool(tool: Tool, kwargs: dict[str, Any], *, call: ToolCall, timeout: float, limit: int, where: str) -> Outcome:
    """Call the tool in a thread so a hung tool times out instead of holding the turn forever.

    A timed-out thread cannot be killed; it is a daemon and dies with the work horse when the turn ends.
    """
    if tool.takes_key:
        kwargs = {**kwargs, "idempotency_key": call.idempotency_key}
    box: dict[str, Any] = {}
    context = contextvars.copy_context()
    context.run(set_current_call, call)

    def target() -> None:
        try:
            box["value"] = context.run(tool.fn, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is news for the model, not for the worker
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("%s: tool %s timed out after %ss", where, tool.name, timeout)
        return Outcome(
            f"{tool.name} timed out after {timeout:g} s and was abandoned; whether it took effect is unknown.", True
        )
    if "error" in box:
        exc = box["error"]
        log.warning("%s: tool %s raised %s", where, tool.name, type(exc).__name__)
        return Outcome(f"{tool.name} failed: {type(exc).__name__}: {exc}", True)
    return result_text(box.get("value"), limit)
