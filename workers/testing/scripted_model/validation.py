"""Request validation: what the Messages API rejects, rejected here with the API's words."""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from typing import Any

from agentpool.testing.scripted_model.cache import CACHE_TTLS, cache_units, pdf_block_pages
from agentpool.testing.scripted_model.common import ApiError, invalid, is_unoffered_tool_use, sign_thinking
from agentpool.testing.scripted_model.compaction import COMPACT_BETA, leading_state

_TOOL_ID_PATTERN = re.compile(r"^[a-zA-Z0-9_-]+$")


_TOOL_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


MAX_CACHE_BREAKPOINTS = 4
MAX_PDF_PAGES = 100  # in one request, on models with a 200k-token window (the PDF guide)


# Keys each request content block type may carry (the API answers "Extra inputs are not permitted"
# for anything else). Taken from the SDK's *BlockParam TypedDicts.
_BLOCK_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text", "citations", "cache_control"}),
    "image": frozenset({"type", "source", "cache_control", "transformations"}),
    "document": frozenset({"type", "source", "title", "context", "citations", "cache_control"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "server_tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "web_search_tool_result": frozenset({"type", "tool_use_id", "content", "cache_control", "caller"}),
    # Beta (compact-2026-01-12): what a compaction returned, sent back verbatim.
    "compaction": frozenset({"type", "content", "encrypted_content", "signature", "tool_changes", "cache_control"}),
}


# Required keys and the JSON type each must have.
_BLOCK_REQUIRED: dict[str, dict[str, type]] = {
    "text": {"text": str},
    "image": {"source": dict},
    "document": {"source": dict},
    "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str},
    "thinking": {"thinking": str, "signature": str},
    "redacted_thinking": {"data": str},
    "server_tool_use": {"id": str, "name": str, "input": dict},
    "web_search_tool_result": {"tool_use_id": str, "content": object},
    "compaction": {},
}
# Block types that exist only behind a beta header.
_BETA_BLOCKS = {"compaction": COMPACT_BETA}
# Fields the API takes as null: a compaction block's (null content is a failed compaction, a no-op).
_NULLABLE = {"compaction": frozenset({"content", "encrypted_content", "signature", "tool_changes"})}


_TOOL_RESULT_CONTENT_TYPES = ("text", "image", "document", "search_result")


_JSON_TYPE_WORDS = {
    str: "a valid string",
    dict: "a valid dictionary",
    list: "a valid list",
    bool: "a valid boolean",
    int: "a valid integer",
    float: "a valid number",
}


# What the API's validator says when a careless model_dump() sends a None it does not accept.
_NULL_MESSAGES = {
    "citations": "Input should be a valid list",
    "caller": "Input should be a valid dictionary or object to extract fields from",
    "cache_control": "Input should be a valid dictionary or object to extract fields from",
    "input": "Input should be a valid dictionary",
    "source": "Input should be a valid dictionary or object to extract fields from",
    "is_error": "Input should be a valid boolean",
    "content": "Input should be a valid list",
}


def _check_type(path: str, value: Any, expected: type | tuple[type, ...], what: str) -> None:
    # bool is an int subclass in Python but never a valid number/integer in JSON Schema terms.
    if isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,)):
        raise invalid(f"{path}: Input should be {what}")
    if not isinstance(value, expected):
        raise invalid(f"{path}: Input should be {what}")


def _validate_top_level(body: dict) -> None:
    for key in ("model", "max_tokens", "messages"):
        if key not in body:
            raise invalid(f"{key}: Field required")
    _check_type("model", body["model"], str, "a valid string")
    _check_type("max_tokens", body["max_tokens"], int, "a valid integer")
    if body["max_tokens"] < 1:
        raise invalid("max_tokens: Input should be greater than or equal to 1")
    _check_type("messages", body["messages"], list, "a valid list")
    if not body["messages"]:
        raise invalid("messages: at least one message is required")
    typed = {
        "system": ((str, list), "a valid string or list"),
        "tools": (list, "a valid list"),
        "tool_choice": (dict, "a valid dictionary"),
        "stop_sequences": (list, "a valid list"),
        "temperature": ((int, float), "a valid number"),
        "top_p": ((int, float), "a valid number"),
        "top_k": (int, "a valid integer"),
        "metadata": (dict, "a valid dictionary"),
        "stream": (bool, "a valid boolean"),
        "thinking": (dict, "a valid dictionary"),
        "context_management": (dict, "a valid dictionary"),
    }
    for key, (expected, what) in typed.items():
        if key in body:
            _check_type(key, body[key], expected, what)
    for i, seq in enumerate(body.get("stop_sequences") or []):
        _check_type(f"stop_sequences.{i}", seq, str, "a valid string")
    _validate_thinking_config(body)


def _validate_thinking_config(body: dict) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise invalid("thinking.enabled.budget_tokens: Field required")
        if budget < 1024:
            raise invalid("thinking.enabled.budget_tokens: Input should be greater than or equal to 1024")
        if budget >= body["max_tokens"]:
            raise invalid("`max_tokens` must be greater than `thinking.budget_tokens`.")


def _validate_cache_control(path: str, value: Any) -> None:
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise invalid(f"{path}.type: Input should be 'ephemeral'")
    if "ttl" in value and value["ttl"] not in CACHE_TTLS:
        raise invalid(f"{path}.ttl: Input should be '5m' or '1h'")


def _validate_tools(tools: list | None) -> set[str]:
    """Validate ``tools``; return the names of the custom (client) tools."""
    names: set[str] = set()
    custom: set[str] = set()
    for i, tool in enumerate(tools or []):
        path = f"tools.{i}"
        _check_type(path, tool, dict, "a valid dictionary")
        is_custom = tool.get("type") in (None, "custom")
        tag = "custom" if is_custom else str(tool.get("type"))
        for key, value in tool.items():
            if value is None and key not in ("type", "cache_control", "eager_input_streaming"):
                raise invalid(f"{path}.{tag}.{key}: Input should not be null")
        name = tool.get("name")
        if not isinstance(name, str):
            raise invalid(f"{path}.{tag}.name: Field required")
        if is_custom:
            if not _TOOL_NAME_PATTERN.match(name):
                raise invalid(f"{path}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise invalid(f"{path}.custom.input_schema: Field required")
            if schema.get("type") != "object":
                raise invalid(f"{path}.custom.input_schema.type: Input should be 'object'")
            custom.add(name)
        if tool.get("cache_control") is not None:
            _validate_cache_control(f"{path}.{tag}.cache_control", tool["cache_control"])
        if name in names:
            raise invalid("tools: Tool names must be unique.")
        names.add(name)
    return custom


def _validate_tool_choice(body: dict, tool_names: set[str]) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
    if kind == "tool" and choice.get("name") not in tool_names:
        raise invalid(f"tool_choice.tool.name: tool `{choice.get('name')}` is not defined in `tools`")
    if kind in ("any", "tool") and not body.get("tools"):
        raise invalid("tool_choice: `tools` must be provided when `tool_choice` requires a tool")


def _validate_system(system: Any) -> None:
    if not isinstance(system, list):
        return
    for i, block in enumerate(system):
        path = f"system.{i}"
        _check_type(path, block, dict, "a valid dictionary")
        if block.get("type") != "text":
            raise invalid(f"{path}.type: Input should be 'text'")
        _validate_block_keys(path, block, "text")


def _validate_block_keys(path: str, block: dict, kind: str) -> None:
    """Nulls, extra keys and required keys of one content block."""
    for key, value in block.items():
        # The API accepts some nulls (e.g. cache_control), but a null here nearly always comes from
        # model_dump() instead of to_dict(mode="json"); we reject every null to catch that early.
        if value is None:
            if key in _NULLABLE.get(kind, ()):
                continue
            if kind == "document" and key == "citations":
                raise invalid(f"{path}.{key}: Input should be a valid dictionary")
            raise invalid(f"{path}.{key}: {_NULL_MESSAGES.get(key, 'Input should be a valid string')}")
        if key not in _BLOCK_KEYS[kind]:
            raise invalid(f"{path}.{kind}.{key}: Extra inputs are not permitted")
    for key, expected in _BLOCK_REQUIRED[kind].items():
        if key not in block:
            raise invalid(f"{path}.{kind}.{key}: Field required")
        if expected is not object and not isinstance(block[key], expected):
            raise invalid(f"{path}.{kind}.{key}: Input should be {_JSON_TYPE_WORDS[expected]}")
    if "cache_control" in block:
        _validate_cache_control(f"{path}.{kind}.cache_control", block["cache_control"])
    if "citations" in block and kind == "text" and not isinstance(block["citations"], list):
        raise invalid(f"{path}.citations: Input should be a valid list")
    if kind == "text" and not block["text"]:
        raise invalid("messages: text content blocks must be non-empty")


def _block_type(path: str, block: Any, betas: frozenset[str]) -> str:
    if not isinstance(block, dict):
        raise invalid(f"{path}: Input should be a valid dictionary")
    kind = block.get("type")
    known = [k for k in _BLOCK_KEYS if _BETA_BLOCKS.get(k, "") in betas | {""}]
    if kind not in known:
        expected = ", ".join(f"'{k}'" for k in known)
        raise invalid(
            f"{path}: Input tag '{kind}' found using 'type' does not match any of the expected tags: {expected}"
        )
    return kind


def _validate_tool_result(path: str, block: dict) -> None:
    if "is_error" in block and not isinstance(block["is_error"], bool):
        raise invalid(f"{path}.tool_result.is_error: Input should be a valid boolean")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(f"{path}.tool_result.content: Input should be a valid list")
    for k, sub in enumerate(content):
        sub_path = f"{path}.content.{k}"
        if not isinstance(sub, dict) or sub.get("type") not in _TOOL_RESULT_CONTENT_TYPES:
            kind = sub.get("type") if isinstance(sub, dict) else None
            raise invalid(
                f"{sub_path}: Input tag '{kind}' found using 'type' does not match any of "
                f"the expected tags: " + ", ".join(f"'{t}'" for t in _TOOL_RESULT_CONTENT_TYPES)
            )
        if sub["type"] in _BLOCK_KEYS:
            _validate_block_keys(sub_path, sub, sub["type"])


def _validate_block(
    path: str,
    block: Any,
    role: str,
    tool_names: set[str] | None,
    has_tools: bool,
    seen_ids: set[str],
    betas: frozenset[str],
) -> str:
    """One content block. ``tool_names`` None: a conversation checked outside any request, so what
    only a request settles (its tools, this server's thinking signatures) is not checked."""
    request = tool_names is not None
    kind = _block_type(path, block, betas)
    _validate_block_keys(path, block, kind)
    if kind in ("tool_use", "server_tool_use", "thinking", "redacted_thinking") and role != "assistant":
        raise invalid(f"{path}: `{kind}` blocks can only be in `assistant` messages")
    if kind == "tool_result" and role != "user":
        raise invalid(f"{path}: `tool_result` blocks can only be in `user` messages")
    if request and kind in ("tool_use", "tool_result") and not has_tools:
        raise invalid("Requests which include `tool_use` or `tool_result` blocks must define tools.")
    if kind in ("tool_use", "server_tool_use"):
        if not _TOOL_ID_PATTERN.match(block["id"]):
            raise invalid(f"{path}.{kind}.id: String should match pattern '^[a-zA-Z0-9_-]+$'")
        if block["id"] in seen_ids:
            raise invalid(f"{path}: `tool_use` ids must be unique")
        seen_ids.add(block["id"])
    if (
        tool_names is not None
        and kind == "tool_use"
        and block["name"] not in tool_names
        and not is_unoffered_tool_use(block["id"], block["name"])
    ):
        raise invalid(f"{path}: tool_use block names the tool `{block['name']}`, which is not defined in `tools`")
    if kind == "tool_result":
        _validate_tool_result(path, block)
    if request and kind == "thinking" and not hmac.compare_digest(block["signature"], sign_thinking(block["thinking"])):
        raise invalid(f"{path}: Invalid `signature` in `thinking` block")
    if request and kind == "redacted_thinking":
        # This server never emits redacted thinking, so any such block was not made by "the model".
        raise invalid(f"{path}: Invalid `data` in `redacted_thinking` block")
    return kind


def _message_blocks(i: int, msg: Any) -> tuple[str, list]:
    """Role and content blocks of one message (string content counts as one text block)."""
    path = f"messages.{i}"
    _check_type(path, msg, dict, "a valid dictionary")
    for key in msg:
        if key not in ("role", "content"):
            raise invalid(f"{path}.{key}: Extra inputs are not permitted")
    if "role" not in msg:
        raise invalid(f"{path}.role: Field required")
    if msg["role"] not in ("user", "assistant"):
        raise invalid(f"{path}.role: Input should be 'user' or 'assistant'")
    if "content" not in msg:
        raise invalid(f"{path}.content: Field required")
    content = msg["content"]
    if isinstance(content, str):
        return msg["role"], ([{"type": "text", "text": content}] if content else [])
    if not isinstance(content, list):
        raise invalid(f"{path}.content: Input should be a valid string or list")
    return msg["role"], content


def _check_tool_pairing(parsed: list[tuple[str, list]]) -> None:
    """Every tool_use answered by exactly one tool_result, first in the very next user message."""
    for j, (role, blocks) in enumerate(parsed):
        prev_ids = _tool_use_ids(parsed[j - 1][1]) if j > 0 and parsed[j - 1][0] == "assistant" else []
        if role == "assistant":
            ids = _tool_use_ids(blocks)
            if ids and (j + 1 == len(parsed) or parsed[j + 1][0] != "user"):
                raise _missing_results(j, ids)
            continue
        seen: set[str] = set()
        leading: set[str] = set()
        in_leading_run = True
        for m, block in enumerate(blocks):
            if block.get("type") != "tool_result":
                in_leading_run = False
                continue
            tid = block["tool_use_id"]
            if tid not in prev_ids:
                raise invalid(
                    f"messages.{j}.content.{m}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {tid}. Each `tool_result` block must have a "
                    f"corresponding `tool_use` block in the previous message."
                )
            if tid in seen:
                raise invalid(
                    f"messages.{j}.content.{m}: multiple `tool_result` blocks found for "
                    f"`tool_use_id` {tid}. Each `tool_use` block must have exactly one "
                    f"corresponding `tool_result` block."
                )
            seen.add(tid)
            if in_leading_run:
                leading.add(tid)
        missing = [tid for tid in prev_ids if tid not in leading]
        if missing:
            raise _missing_results(j - 1, missing)


def _tool_use_ids(blocks: list) -> list[str]:
    return [b["id"] for b in blocks if b.get("type") == "tool_use"]


def _missing_results(i: int, ids: list[str]) -> ApiError:
    return invalid(
        f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately "
        f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding "
        f"`tool_result` block in the next message."
    )


def _starts_from_compaction(blocks: list) -> bool:
    first = blocks[0] if blocks else None
    return isinstance(first, dict) and first.get("type") == "compaction" and first.get("content") is not None


def check_conversation(messages: Any, betas: frozenset[str] = frozenset(_BETA_BLOCKS.values())) -> None:
    """Raise :class:`ApiError` with the API's words for a conversation the Messages API would refuse in
    any request: message shapes and roles, every content block (its keys, where it may stand, unique
    tool_use ids), and every tool_result answering a tool_use of the message just before it, exactly
    one each, first in that message. What only a request settles (its tools, the thinking signatures
    of this server, what a final assistant message may end with) is left out. ``validate_request``
    runs the same checks, and ``agentpool.testing.assert_valid_conversation`` is this, so the two
    cannot drift."""
    _check_type("messages", messages, list, "a valid list")
    if not messages:
        raise invalid("messages: at least one message is required")
    _conversation(messages, None, False, betas)


def _conversation(
    messages: list, tool_names: set[str] | None, has_tools: bool, betas: frozenset[str]
) -> list[tuple[str, list]]:
    parsed: list[tuple[str, list]] = []
    seen_ids: set[str] = set()
    for i, msg in enumerate(messages):
        role, blocks = _message_blocks(i, msg)
        # A conversation sent from its compaction point starts with the assistant message holding it.
        if i == 0 and role != "user" and not _starts_from_compaction(blocks):
            raise invalid('messages: first message must use the "user" role')
        if not blocks and i != len(messages) - 1:
            raise invalid(
                f"messages.{i}: all messages must have non-empty content except for the "
                f"optional final assistant message"
            )
        for m, block in enumerate(blocks):
            _validate_block(f"messages.{i}.content.{m}", block, role, tool_names, has_tools, seen_ids, betas)
        parsed.append((role, blocks))
    last_role, last_blocks = parsed[-1]
    if last_role == "user" and not last_blocks:
        raise invalid(
            f"messages.{len(parsed) - 1}: all messages must have non-empty content except "
            f"for the optional final assistant message"
        )
    _check_tool_pairing(parsed)
    return parsed


def _validate_messages(messages: list, tool_names: set[str], has_tools: bool, betas: frozenset[str]) -> None:
    parsed = _conversation(messages, tool_names, has_tools, betas)
    last_role, last_blocks = parsed[-1]
    # A final assistant message is a prefill the model continues from (after max_tokens, pause_turn):
    # it may not end in whitespace, nor in a thinking block, which cannot be continued (the API's
    # words; a thinking block earlier in it, or in an earlier message, is accepted).
    final_kind = last_blocks[-1].get("type") if last_role == "assistant" and last_blocks else None
    if final_kind in ("thinking", "redacted_thinking"):
        raise invalid(f"messages.{len(parsed) - 1}: The final block in an assistant message cannot be `{final_kind}`.")
    if final_kind == "text" and last_blocks[-1]["text"] != last_blocks[-1]["text"].rstrip():
        raise invalid("messages: final assistant content cannot end with trailing whitespace")
    if _pdf_pages(block for _, blocks in parsed for block in blocks) > MAX_PDF_PAGES:
        raise invalid(f"A maximum of {MAX_PDF_PAGES} PDF pages may be provided.")


def _pdf_pages(blocks: Iterable[Any]) -> int:
    """The pages of the PDFs among ``blocks`` and inside their tool results (one a page if unreadable)."""
    pages = 0
    for block in blocks:
        if (counted := pdf_block_pages(block)) is not None:
            pages += counted
        elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            pages += _pdf_pages(block["content"])
    return pages


def count_cache_markers(body: dict) -> int:
    return len(cache_units(body)[1])


def validate_request(body: Any, betas: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """Raise :class:`ApiError` (400) for anything the Messages API would reject, given the request's
    ``anthropic-beta`` features. Returns the state of the compaction block the request starts from."""
    if not isinstance(body, dict):
        raise invalid("Request body must be a JSON object")
    _validate_top_level(body)
    tool_names = _validate_tools(body.get("tools"))
    _validate_tool_choice(body, tool_names)
    _validate_system(body.get("system"))
    _validate_messages(body["messages"], tool_names, bool(body.get("tools")), betas)
    state = leading_state(body["messages"])
    markers = count_cache_markers(body)
    if markers > MAX_CACHE_BREAKPOINTS:
        raise invalid(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {markers}."
        )
    return state
