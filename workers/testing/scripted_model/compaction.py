"""Context management as the Messages API does it, for the scripted model: the context window, the
beta edits in ``context_management`` (``compact_20260112``, ``clear_tool_uses_20250919``), the
``compaction`` blocks a compaction returns and later requests send back, and the summaries a client
asks for itself (agentpool's fallback for models without server-side compaction).

What the API does, as the installed SDK describes it (``anthropic/types/beta/beta_compact_20260112_edit_param.py``,
``beta_compaction_block.py``, ``beta_iterations_usage.py``, ``anthropic/types/compaction_*_error.py``):

- ``context_management`` needs a beta header: ``compact-2026-01-12`` for the compaction edit,
  ``context-management-2025-06-27`` for tool-result clearing; without one the field is unknown. Only
  some models take the compaction edit.
- The compaction edit's trigger is ``{"type": "input_tokens", "value": N}`` with N >= 50,000 (default
  150,000); ``instructions`` and ``pause_after_compaction`` are optional.
- A request whose input passes the trigger is compacted before the model samples: the response starts
  with a ``compaction`` block (summary ``content``, opaque ``encrypted_content``, ``signature``,
  ``tool_changes``), and with ``pause_after_compaction`` holds only that block (stop reason
  ``compaction``). The compaction is a sampling step of its own, reported in ``usage.iterations``
  and not in the top-level usage. A conversation that ends mid-turn (on an assistant message) is not
  compacted.
- Later requests send the block back verbatim as the first block of ``messages``: a block with content
  anywhere else is ``compaction_block_misplaced``, a second one ``compaction_block_ambiguous``, an
  edited summary ``compaction_content_mismatch``, a bad signature ``compaction_signature_invalid``,
  changed tool changes ``compaction_tool_changes_mismatch``. A block whose content is null (a failed
  compaction) is a no-op wherever it is.
- A prompt past the model's context window is refused (400, "prompt is too long"); a response that would
  run past it is cut there and stops with ``model_context_window_exceeded``.

Step selection stays stateless across compactions: the block's ``encrypted_content`` keeps the
conversation's first user text and how many assistant turns it summarizes, and a summary the scripted
model writes for a client names them in its text (``[script:NAME] [turns:N]``).
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from agentpool.testing.scripted_model.common import (
    ApiError,
    canonical,
    digest,
    estimate_tokens,
    invalid,
    sign_opaque,
)
from agentpool.testing.scripted_model.scripts import SCRIPT_MARKER

COMPACT_BETA = "compact-2026-01-12"
CONTEXT_BETA = "context-management-2025-06-27"
COMPACT_EDIT = "compact_20260112"
CLEAR_TOOL_USES_EDIT = "clear_tool_uses_20250919"
CLEAR_THINKING_EDIT = "clear_thinking_20251015"
MIN_TRIGGER = 50_000
DEFAULT_TRIGGER = 150_000
DEFAULT_CONTEXT_WINDOW = 200_000
# The models that take the compaction edit: the docs name Opus 4.6 and 4.7, Sonnet 4.6 and later models.
SERVER_COMPACTION_MODELS = (
    "claude-opus-4-6",
    "claude-opus-4-7",
    "claude-opus-4-8",
    "claude-sonnet-4-6",
    "claude-opus-5",
    "claude-sonnet-5",
    "claude-haiku-5",
    "claude-fable-5",
    "claude-mythos-5",
)
# How a client's own summary request ends: agentpool's fallback compaction prompt starts with this.
SUMMARY_REQUEST_PREFIX = "Context compaction:"
_TURNS_MARK = re.compile(r"\[turns:(\d+)\]")
_COMPACTED = "(compacted)"


def betas_of(header: str | None) -> frozenset[str]:
    return frozenset(b.strip() for b in (header or "").split(",") if b.strip())


def supports_compaction(model: str) -> bool:
    return model.startswith(SERVER_COMPACTION_MODELS)


def _error(code: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message, code=code)


# -- the edits -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edits:
    compact: dict[str, Any] | None = None  # trigger (int), instructions, pause_after_compaction
    clear_tool_uses: dict[str, Any] | None = None


def _keys(path: str, value: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{path}: Input should be a valid dictionary")
    for key in value:
        if key not in allowed:
            raise invalid(f"{path}.{key}: Extra inputs are not permitted")
    return value


def _count(path: str, value: Any, kinds: tuple[str, ...], minimum: int) -> tuple[str, int]:
    _keys(path, value, {"type", "value"})
    if value.get("type") not in kinds:
        raise invalid(f"{path}.type: Input should be " + " or ".join(f"'{k}'" for k in kinds))
    number = value.get("value")
    if not isinstance(number, int) or isinstance(number, bool):
        raise invalid(f"{path}.value: Input should be a valid integer")
    if number < minimum:
        raise invalid(f"{path}.value: Input should be greater than or equal to {minimum}")
    return value["type"], number


def _compact_edit(path: str, edit: dict[str, Any]) -> dict[str, Any]:
    _keys(path, edit, {"type", "trigger", "instructions", "pause_after_compaction"})
    trigger = DEFAULT_TRIGGER
    if edit.get("trigger") is not None:
        trigger = _count(f"{path}.trigger", edit["trigger"], ("input_tokens",), MIN_TRIGGER)[1]
    if edit.get("instructions") is not None and not isinstance(edit["instructions"], str):
        raise invalid(f"{path}.instructions: Input should be a valid string")
    pause = edit.get("pause_after_compaction", False)
    if not isinstance(pause, bool):
        raise invalid(f"{path}.pause_after_compaction: Input should be a valid boolean")
    return {"trigger": trigger, "instructions": edit.get("instructions"), "pause": pause}


def _clear_edit(path: str, edit: dict[str, Any]) -> dict[str, Any]:
    _keys(path, edit, {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"})
    trigger = ("input_tokens", 100_000)
    if edit.get("trigger") is not None:
        trigger = _count(f"{path}.trigger", edit["trigger"], ("input_tokens", "tool_uses"), 1)
    keep = 3
    if edit.get("keep") is not None:
        keep = _count(f"{path}.keep", edit["keep"], ("tool_uses",), 0)[1]
    if edit.get("clear_at_least") is not None:
        _count(f"{path}.clear_at_least", edit["clear_at_least"], ("input_tokens",), 0)
    exclude = edit.get("exclude_tools") or []
    if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        raise invalid(f"{path}.exclude_tools: Input should be a valid list of strings")
    inputs = edit.get("clear_tool_inputs", False)
    if not (isinstance(inputs, bool) or (isinstance(inputs, list) and all(isinstance(n, str) for n in inputs))):
        raise invalid(f"{path}.clear_tool_inputs: Input should be a valid boolean or list of strings")
    return {"trigger": trigger, "keep": keep, "exclude": set(exclude)}


def parse_edits(body: dict[str, Any], betas: frozenset[str]) -> Edits:
    """The request's ``context_management``, checked as the API checks it."""
    config = body.get("context_management")
    if config is None:
        return Edits()
    if not betas & {COMPACT_BETA, CONTEXT_BETA}:
        raise invalid("context_management: Extra inputs are not permitted")
    edits = _keys("context_management", config, {"edits"}).get("edits", [])
    if not isinstance(edits, list):
        raise invalid("context_management.edits: Input should be a valid list")
    if edits and body.get("compaction") is not None:
        raise invalid("`compaction` cannot be combined with `context_management`")
    compact = clear = None
    for i, edit in enumerate(edits):
        path = f"context_management.edits.{i}"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind == COMPACT_EDIT:
            if COMPACT_BETA not in betas:
                raise invalid(f"{path}: `{COMPACT_EDIT}` requires the `anthropic-beta: {COMPACT_BETA}` header")
            if compact is not None:
                raise invalid(f"{path}: only one `{COMPACT_EDIT}` edit may be given")
            if not supports_compaction(body["model"]):
                raise invalid(f"{path}: `{COMPACT_EDIT}` is not supported on model `{body['model']}`")
            compact = _compact_edit(path, edit)
        elif kind in (CLEAR_TOOL_USES_EDIT, CLEAR_THINKING_EDIT):
            if CONTEXT_BETA not in betas:
                raise invalid(f"{path}: `{kind}` requires the `anthropic-beta: {CONTEXT_BETA}` header")
            if kind == CLEAR_TOOL_USES_EDIT:
                clear = _clear_edit(path, edit)
            else:
                _keys(path, edit, {"type", "keep"})
        else:
            expected = ", ".join(f"'{k}'" for k in (CLEAR_TOOL_USES_EDIT, CLEAR_THINKING_EDIT, COMPACT_EDIT))
            raise invalid(
                f"{path}: Input tag '{kind}' found using 'type' does not match any of the expected tags: {expected}"
            )
    return Edits(compact, clear)


# -- compaction blocks -------------------------------------------------------------------------------


def _gist(text: str) -> str:
    """Enough of the first user text to select the same script again: its head and its markers."""
    if len(text) <= 400:
        return text
    return f"{text[:200]} ... {' '.join(m.group(0) for m in SCRIPT_MARKER.finditer(text))}"


def make_block(summary: str, *, first_text: str, turns: int) -> dict[str, Any]:
    """A signed compaction block; ``encrypted_content`` holds what step selection needs afterwards."""
    tool_changes: list[Any] = []
    state = {"v": 1, "first": _gist(first_text), "turns": turns, "digest": digest(summary), "tools": tool_changes}
    opaque = base64.b64encode(canonical(state).encode()).decode()
    return {
        "type": "compaction",
        "content": summary,
        "encrypted_content": opaque,
        "signature": sign_opaque("compaction", opaque),
        "tool_changes": tool_changes,
    }


def _verify(path: str, block: dict[str, Any]) -> dict[str, Any]:
    content, opaque, signature = block.get("content"), block.get("encrypted_content"), block.get("signature")
    if not isinstance(content, str) or not content:
        raise invalid(f"{path}.content: a compaction summary must be a non-empty string or null")
    if not isinstance(opaque, str) or not isinstance(signature, str) or signature != sign_opaque("compaction", opaque):
        raise _error("compaction_signature_invalid", f"{path}: the `compaction` block's `signature` does not verify")
    try:
        state = json.loads(base64.b64decode(opaque, validate=True))
    except (binascii.Error, ValueError):
        raise _error("compaction_signature_invalid", f"{path}: `encrypted_content` is not what was returned") from None
    if digest(content) != state["digest"]:
        raise _error(
            "compaction_content_mismatch",
            f"{path}: the `compaction` block's `content` differs from the summary its `signature` recorded",
        )
    if block.get("tool_changes") != state["tools"]:
        raise _error(
            "compaction_tool_changes_mismatch",
            f"{path}: the `compaction` block's `tool_changes` differ from what was returned with it",
        )
    return state


def leading_state(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Check every compaction block of a (shape-validated) request; the state of the block it starts
    from, or None when it has none."""
    found: list[tuple[int, int, str, dict[str, Any]]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            if not (isinstance(block, dict) and block.get("type") == "compaction"):
                continue
            path = f"messages.{i}.content.{j}"
            if message["role"] != "assistant":
                raise _error(
                    "compaction_block_misplaced", f"{path}: a `compaction` block belongs in an assistant message"
                )
            if block.get("content") is not None:
                found.append((i, j, path, block))
    if not found:
        return None
    if len(found) > 1:
        raise _error(
            "compaction_block_ambiguous",
            f"{found[1][2]}: `messages` holds more than one `compaction` block with content; "
            "send only the block the conversation returned last",
        )
    i, j, path, block = found[0]
    if (i, j) != (0, 0):
        raise _error(
            "compaction_block_misplaced", f"{path}: the `compaction` block must be the first block of `messages`"
        )
    return _verify(path, block)


# -- step selection across compactions ----------------------------------------------------------------


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text")


def step_view(messages: list[dict[str, Any]], state: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The conversation as step selection sees it: the first user text of the whole conversation, a
    placeholder turn for each assistant turn compacted away, then what the request carries after its
    compaction point (a compaction block alone, from ``pause_after_compaction``, is no turn)."""
    if state is not None:
        first, before = str(state["first"]), int(state["turns"])
        rest_of_first = [b for b in messages[0]["content"][1:]]
        rest = ([{"role": "assistant", "content": rest_of_first}] if rest_of_first else []) + messages[1:]
    else:
        match = _TURNS_MARK.search(_text_of(messages[0])) if messages[0]["role"] == "user" else None
        if match is None:
            return messages
        first, before, rest = _text_of(messages[0]), int(match.group(1)), messages[1:]
    turn = [{"role": "assistant", "content": _COMPACTED}, {"role": "user", "content": _COMPACTED}]
    return [{"role": "user", "content": first}, *turn * before, *rest]


def is_summary_request(messages: list[dict[str, Any]]) -> bool:
    """A client asking for a summary of the conversation (agentpool's fallback compaction)."""
    last = messages[-1]
    blocks = last.get("content")
    return (
        last["role"] == "user"
        and isinstance(blocks, list)
        and bool(blocks)
        and blocks[-1].get("type") == "text"
        and blocks[-1].get("text", "").startswith(SUMMARY_REQUEST_PREFIX)
    )


# A line of a summary that the summaries made after it keep, as a model keeps what the summary it was
# given says to remember.
REMEMBER = "Remember:"


def summary_text(name: str, turns: int, view: list[dict[str, Any]], extra: str | None = None) -> str:
    """What the scripted model writes when it summarizes: the markers step selection reads back, the
    task, the gist of the last tool results, and every ``Remember:`` line of the summary (or text) the
    conversation starts from, as far as the request carries it."""
    results: list[str] = []
    for message in view:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                body = block.get("content")
                text = body if isinstance(body, str) else canonical(body)
                results.append(text[:80])
    task = _TURNS_MARK.sub("", _text_of(view[0]))[:300].strip()
    lines = [f"Summary of the conversation so far [script:{name}] [turns:{turns}]", f"Task: {task}"]
    if results:
        lines.append("Latest tool results: " + " | ".join(results[-3:]))
    lines += [line for line in _text_of(view[0]).splitlines() if line.startswith(REMEMBER)]
    if extra:
        lines.append(extra)
    return "\n".join(lines)


# -- what the model reads ------------------------------------------------------------------------------


def clear_tool_uses(body: dict[str, Any], edit: dict[str, Any] | None, input_tokens: int) -> tuple[dict, dict | None]:
    """The request with old tool results cleared when the edit's trigger is passed, and the applied edit."""
    if edit is None:
        return body, None
    kind, value = edit["trigger"]
    results = [
        (i, j)
        for i, m in enumerate(body["messages"])
        if isinstance(m.get("content"), list)
        for j, b in enumerate(m["content"])
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]
    if (input_tokens if kind == "input_tokens" else len(results)) < value or len(results) <= edit["keep"]:
        return body, None
    names = {
        b["id"]: b["name"]
        for m in body["messages"]
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_use"
    }
    cleared = copy.deepcopy(body)
    count = saved = 0
    for i, j in results[: len(results) - edit["keep"]]:
        block = cleared["messages"][i]["content"][j]
        if names.get(block["tool_use_id"]) in edit["exclude"]:
            continue
        saved += estimate_tokens(canonical(block.get("content", "")))
        block["content"] = "[cleared to save context]"
        count += 1
    applied = {"type": CLEAR_TOOL_USES_EDIT, "cleared_tool_uses": count, "cleared_input_tokens": saved}
    return cleared, {"applied_edits": [applied]}


def check_prompt_fits(input_tokens: int, window: int) -> None:
    if input_tokens > window:
        raise invalid(f"prompt is too long: {input_tokens} tokens > {window} maximum")


def fit_output(content: list[dict[str, Any]], room: int) -> tuple[list[dict[str, Any]], bool]:
    """The content cut where the context window ends (``room`` tokens), and whether it was cut."""
    if estimate_tokens(canonical(content)) <= room:
        return content, False
    kept: list[dict[str, Any]] = []
    used = 0
    for block in content:
        cost = estimate_tokens(canonical(block))
        if used + cost <= room:
            kept.append(block)
            used += cost
            continue
        if block["type"] == "text":
            # No trailing whitespace: the client sends this back as the last message to continue it.
            text = block["text"][: max(0, (room - used) * 4 - 32)].rstrip()
            if text:
                kept.append({**block, "text": text})
        break
    return kept or [{"type": "text", "text": "..."}], True
