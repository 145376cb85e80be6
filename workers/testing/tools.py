"""Calling one tool in a unit test as a worker calls it: input validated against its schema,
``current_call()`` set, the idempotency key passed, an ``async def`` tool run to completion.

::

    from agentpool.testing import call_tool, tool_result

    def test_ticket_uses_the_idempotency_key():
        assert call_tool(create_ticket, title="Changelog", body="late") == "ticket AB12CD created"

    def test_bad_input_is_what_the_model_would_be_told():
        result = tool_result(create_ticket, title=42)        # the model's view: content and is_error
        assert result.is_error and "title" in result.content
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentpool.context import ToolCall, current_call, set_current_call
from agentpool.runtime.reconcile import idempotency_key
from agentpool.runtime.toolcall import bounded, run_tool
from agentpool.store.ledger import Outcome
from agentpool.tools import Tool, ToolInputError


@contextmanager
def tool_context(
    *, run_id: str = "r_test", turn: int = 0, tool_use_id: str = "toolu_test", attempt: int = 1
) -> Iterator[ToolCall]:
    """``current_call()`` inside the block returns this call, as it does inside a worker; the
    idempotency key is the one a worker would derive for this run and tool_use."""
    call = ToolCall(run_id, turn, tool_use_id, idempotency_key(run_id, tool_use_id), attempt)
    before = current_call()
    set_current_call(call)
    try:
        yield call
    finally:
        set_current_call(before)


def _checked(tool: Any, tool_input: dict[str, Any] | None, fields: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(tool, Tool):
        raise TypeError(f"call_tool takes a function decorated with @tool, got {type(tool).__name__}")
    return {**(tool_input or {}), **fields}


def call_tool(
    tool: Tool,
    tool_input: dict[str, Any] | None = None,
    /,
    *,
    run_id: str = "r_test",
    turn: int = 0,
    tool_use_id: str = "toolu_test",
    attempt: int = 1,
    **fields: Any,
) -> Any:
    """Call ``tool`` with the model's input (``tool_input``, and/or keyword ``fields``) as a worker
    would, and return what it returns; what it raises is raised. Input the schema refuses raises
    :class:`~agentpool.tools.ToolInputError` with the message the model would get. Pass input whose
    names clash with this function's own keywords (``run_id``...) in ``tool_input``."""
    given = _checked(tool, tool_input, fields)
    kwargs = tool.validate(given)
    with tool_context(run_id=run_id, turn=turn, tool_use_id=tool_use_id, attempt=attempt) as call:
        if tool.takes_key:
            kwargs["idempotency_key"] = call.idempotency_key
        return tool.fn(**kwargs)


def tool_result(
    tool: Tool,
    tool_input: dict[str, Any] | None = None,
    /,
    *,
    run_id: str = "r_test",
    turn: int = 0,
    tool_use_id: str = "toolu_test",
    attempt: int = 1,
    timeout: float | None = None,
    max_result_chars: int = 100_000,
    **fields: Any,
) -> Outcome:
    """What the model would be sent for this call: ``.content`` and ``.is_error``, through the worker's
    own code (its timeout, default 120 s or the tool's; a raised exception or a bad input becomes an
    ``is_error`` result; a long result is cut at ``max_result_chars``)."""
    given = _checked(tool, tool_input, fields)
    try:
        kwargs = tool.validate(given)
    except ToolInputError as exc:
        return Outcome(str(exc), True)
    call = ToolCall(run_id, turn, tool_use_id, idempotency_key(run_id, tool_use_id), attempt)
    outcome = run_tool(tool, kwargs, call=call, timeout=timeout or tool.timeout or 120.0, where="test")
    return bounded(outcome, max_result_chars)
