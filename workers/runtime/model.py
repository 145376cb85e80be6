"""The model adapter: the only module that imports ``anthropic``.

The client is configured from the environment as the SDK does (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL).
The SDK's own retries are off: it honours ``retry-after`` without a cap, which would park a worker for
as long as the API asks. Transient errors instead come back as ``ModelUnavailable`` and the turn is
retried later as a deferred turn (agentpool.runtime.deferred), so no worker sleeps.

Every call streams, through the SDK's raw streaming response (``client.messages``, or
``client.beta.messages`` when the request needs a beta: the API's compaction, tool-result clearing), as
the API asks of calls that may run long; its events are read as plain JSON and accumulated as the SDK's
helpers do (``agentpool.runtime.reply_stream``), into the message exactly as the API produced it
(thinking blocks with their signatures, compaction blocks). Block starts and deltas go to the turn's
``LiveOutput`` as they arrive. ``AGENTPOOL_MODEL_TIMEOUT`` is the longest silence allowed between two
events (the HTTP read timeout; the API's pings keep a slow call alive), ``AGENTPOOL_MODEL_CALL_TIMEOUT``
caps a whole call, checked at every event, pings included. A stream
cut midway (the connection lost, that silence, an ``error`` event such as ``overloaded_error`` after
the 200) is transient, like a 529: ``ModelUnavailable`` carries the tokens the stream had reported
(``message_start``'s usage, then each ``message_delta``'s cumulative usage), which the turn counts.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anthropic
import httpx2

from agentpool.agent import SUMMARY_PREAMBLE, SUMMARY_PROMPT, Agent, Compaction
from agentpool.runtime import tracing
from agentpool.runtime.reply_stream import Reply, StreamError, events
from agentpool.runtime.settings import Settings
from agentpool.store.errors import AgentPoolError
from agentpool.store.records import USAGE_FIELDS, tool_uses

CACHE = {"type": "ephemeral"}
# 429 bodies that will not clear by waiting (a spend or credit limit), by the words the API uses.
_NON_TRANSIENT_429 = ("usage limit", "spend limit", "credit balance", "billing")
COMPACT_BETA = "compact-2026-01-12"  # the compact_20260112 edit (anthropic/types/anthropic_beta_param.py)
CONTEXT_BETA = "context-management-2025-06-27"  # the clear_tool_uses_20250919 edit
# An `error` event after the 200 is transient unless it names one of these.
_FINAL_ERROR_TYPES = ("invalid_request_error", "authentication_error", "permission_error", "not_found_error")


# What an API key or token looks like in an error text a gateway echoed back (with its request headers).
_SECRET_PATTERNS = (
    re.compile(r"sk-ant-[A-Za-z0-9_\-]{6,}"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=\-]{6,}"),
    re.compile(r"(?i)(x-api-key['\"]?\s*[:=]\s*['\"]?)[^\s'\",}]+"),
)
_SECRET_ENV = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")
MAX_ERROR_CHARS = 2000


def scrub(text: str) -> str:
    """An error text from the model API, safe to store in a run, an event and a log: the API key or
    token (from the environment, or anything shaped like one) masked, and the text capped."""
    for name in _SECRET_ENV:
        secret = os.environ.get(name) or ""
        if len(secret) >= 8:
            text = text.replace(secret, "***")
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + "***", text)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "…"


class _ModelError(AgentPoolError):
    """An error of the model API, its text scrubbed of secrets when it is made (``scrub``)."""

    def __init__(self, message: str) -> None:
        super().__init__(scrub(message))


class ModelUnavailable(_ModelError):
    """A transient failure (429, 529, 5xx, timeout, connection): try the same turn again later."""

    retryable = True

    def __init__(
        self,
        message: str,
        retry_after: float | None = None,
        kind: str = "connection",
        spent: dict[str, int] | None = None,
        limits: dict[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.limits = limits or {}  # the reply's anthropic-ratelimit-* headers (a 429 has them)
        self.kind = kind  # the API's error type (rate_limit_error, overloaded_error, ...), "connection", "timeout"
        self.status = status  # the HTTP status of an error reply (None: no reply, or an error mid-stream)
        self.spent = {k: v for k, v in (spent or {}).items() if v}  # tokens a cut stream had reported: billed


class ModelRejected(_ModelError):
    """The API refused the request and retrying cannot help (400-class): the run fails. ``spent``: the
    tokens a stream refused midway (an ``error`` event of a final type after the 200) had reported:
    billed, so counted before the run fails."""

    def __init__(self, message: str, *, spent: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.spent = {k: v for k, v in (spent or {}).items() if v}


class ContextTooLong(ModelRejected):
    """The API refused the request as longer than the model's context window ("prompt is too long")."""


class ModelQuotaExhausted(_ModelError):
    """A 429 caused by a spend or credit limit: the run stops, resumable once the limit is raised."""


@dataclass(frozen=True)
class ModelReply:
    message: dict[str, Any]  # {"role": "assistant", "content": [...]} as the API returned it
    stop_reason: str
    usage: dict[str, int]  # every token billed, a server-side compaction's included
    meta: dict[str, Any]  # response id, model, stop_reason, usage: kept beside the message
    seconds: float = 0.0  # the call, from request to last event
    compacted: bool = False  # the API compacted the conversation: the reply starts with a compaction block
    limits: dict[str, str] = field(default_factory=dict)  # the reply's anthropic-ratelimit-* headers


# Told the API's id for a call and the usage it reported so far, once the call's reply begins.
OnStart = Callable[[str, dict[str, int]], None]


class DeltaSink(Protocol):
    """Where a streamed call's output goes as it arrives (``agentpool.runtime.stream.LiveOutput``)."""

    def block_start(self, index: int, block: str, name: str | None = None) -> None: ...
    def delta(self, index: int, kind: str, text: str) -> None: ...
    def close(self, outcome: str) -> None: ...


_clients: dict[int, tuple[anthropic.Anthropic, Settings]] = {}


def _client() -> tuple[anthropic.Anthropic, Settings]:
    # One client per process: an httpx pool must not cross a fork into a work horse. Its read timeout
    # is the longest silence allowed between a stream's events.
    pid = os.getpid()
    if pid not in _clients:
        settings = Settings.from_env()
        client = anthropic.Anthropic(max_retries=0, timeout=anthropic.Timeout(settings.model_idle_timeout))
        _clients[pid] = (client, settings)
    return _clients[pid]


def reset_client() -> None:
    """Close this process's client, so that the next call builds one from the environment as it is now
    (a test that changes ``ANTHROPIC_BASE_URL`` or ``AGENTPOOL_MODEL_STREAMING`` between calls)."""
    made = _clients.pop(os.getpid(), None)
    if made is not None:
        made[0].close()


def warm_up() -> None:
    """Do the SDK's lazy one-time work (imports, building the validators of the response and of every
    stream event type) in a process that forks work horses, so each horse does not pay for it on every
    turn (~200 ms for a create(), ~40 ms more for a stream). A stream and a create() run against an
    in-process transport: no connection is made, and no client is kept (an HTTP pool must not cross a
    fork)."""
    message = {
        "id": "msg_warm_up",
        "type": "message",
        "role": "assistant",
        "model": "warm-up",
        "content": [
            {"type": "thinking", "thinking": "t", "signature": "s"},
            {"type": "text", "text": "t"},
            {"type": "tool_use", "id": "toolu_warm_up", "name": "t", "input": {"k": "v"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    sse = _warm_up_events(message)

    def answer(request: httpx2.Request) -> httpx2.Response:
        if b'"stream":true' in request.content.replace(b" ", b""):
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=sse)
        return httpx2.Response(200, json=message)

    anthropic.Anthropic(api_key="warm-up", max_retries=0).close()  # the HTTP stack a real client builds
    transport = httpx2.Client(transport=httpx2.MockTransport(answer))
    with anthropic.Anthropic(
        api_key="warm-up", base_url="http://warm-up", max_retries=0, http_client=transport
    ) as client:
        request: dict[str, Any] = {"model": "warm-up", "max_tokens": 1, "messages": [{"role": "user", "content": "."}]}
        client.messages.create(**request).to_dict(mode="json")
        # The streamed path a turn takes (the SDK's raw streaming response, read by reply_stream), with
        # and without betas: ~14 ms a horse when it was not warmed here (bench --only overhead).
        for betas in (None, ["warm-up"]):
            _streamed(client, {**request, **({"betas": betas} if betas else {})}, None, deadline=math.inf, headers={})


def _warm_up_events(message: dict[str, Any]) -> bytes:
    def event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    deltas = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}
    out = [event("message_start", {"message": {**message, "content": [], "stop_reason": None}}), event("ping", {})]
    for i, block in enumerate(message["content"]):
        start = {**block, "input": {}} if block["type"] == "tool_use" else {**block, block["type"]: ""}
        out.append(event("content_block_start", {"index": i, "content_block": start}))
        if block["type"] == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            kind, field = deltas[block["type"]]
            delta = {"type": kind, field: block[field]}
        out.append(event("content_block_delta", {"index": i, "delta": delta}))
        if block["type"] == "thinking":
            out.append(
                event("content_block_delta", {"index": i, "delta": {"type": "signature_delta", "signature": "s"}})
            )
        out.append(event("content_block_stop", {"index": i}))
    out.append(
        event(
            "message_delta",
            {"delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 1}},
        )
    )
    out.append(event("message_stop", {}))
    return "".join(out).encode()


WITHDRAWN = (
    "This tool is no longer available (its definition was removed or its MCP server stopped offering it). "
    "Do not call it."
)


def withdrawn_tools(messages: list[dict[str, Any]], offered: set[str]) -> list[dict[str, Any]]:
    """A definition for each tool the window's tool_use blocks name but the agent no longer offers (new
    code deployed, an MCP server's tool list changed since a crash): the API refuses a request whose
    history names a tool that ``tools`` does not define, so without it the run could never go on."""
    names = dict.fromkeys(block["name"] for block in tool_uses(messages))
    gone = [name for name in names if name not in offered]
    return [{"name": name, "description": WITHDRAWN, "input_schema": {"type": "object"}} for name in gone]


def build_request(
    agent: Agent, messages: list[dict[str, Any]], *, summary: bool = False, shrink: bool = False
) -> dict[str, Any]:
    """The request, with cache breakpoints on the tools, the system prompt and the last message.

    The breakpoint on the last message moves every turn and is added to a copy here, never stored, so
    the stored history stays byte-identical and a run resumed elsewhere reads its prefix from the cache.
    ``messages`` is the run's window (it starts at its latest compaction point). A ``summary`` request is
    agentpool's own compaction: the same prefix (read from the cache), the summary prompt after the
    window, no tool to call, no thinking, none of the API's context edits.
    """
    tools = agent.tool_params()
    tools += withdrawn_tools(messages, {t["name"] for t in tools})
    if tools:
        tools[-1] = {**tools[-1], "cache_control": CACHE}
    options = dict(agent.model_options)
    compaction = agent.compaction if isinstance(agent.compaction, Compaction) else None
    if summary:
        options.pop("thinking", None)
        messages = summary_messages(messages, compaction.instructions if compaction else None, shrink=shrink)
    request: dict[str, Any] = {
        "model": agent.model,
        "max_tokens": compaction.summary_max_tokens if summary and compaction else agent.max_tokens,
        "messages": _with_moving_breakpoint(_continuable(messages)),
        **options,
    }
    if tools:
        request["tools"] = tools
        if summary:
            request["tool_choice"] = {"type": "none"}
    if agent.system:
        request["system"] = [{"type": "text", "text": agent.system, "cache_control": CACHE}]
    if compaction and not summary:
        _add_context_edits(request, compaction, server=agent.compaction_mode == "server")
    if "betas" not in request and any(_starts_with_compaction(m) for m in messages[:1]):
        # The window starts from a compaction block (the API's): sent back, it needs the beta, even
        # in a request that asks for no compaction (a summary call, an agent since switched to summaries).
        request["betas"] = [COMPACT_BETA]
    return request


def _starts_with_compaction(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and bool(content) and content[0].get("type") == "compaction"


def _add_context_edits(request: dict[str, Any], compaction: Compaction, *, server: bool) -> None:
    edits: list[dict[str, Any]] = []
    betas = set(request.get("betas") or ())
    if compaction.clear_tool_uses:
        settings = compaction.clear_tool_uses if isinstance(compaction.clear_tool_uses, dict) else {}
        edits.append({**settings, "type": "clear_tool_uses_20250919"})
        betas.add(CONTEXT_BETA)
    if server:
        edit: dict[str, Any] = {
            "type": "compact_20260112",
            "trigger": {"type": "input_tokens", "value": compaction.trigger},
        }
        if compaction.instructions:
            edit["instructions"] = compaction.instructions
        if compaction.pause_after_compaction:
            edit["pause_after_compaction"] = True
        edits.append(edit)
        betas.add(COMPACT_BETA)
    if edits:
        request["context_management"] = {"edits": edits}
        request["betas"] = sorted(betas)


def summary_messages(
    window: list[dict[str, Any]], instructions: str | None, *, shrink: bool = False
) -> list[dict[str, Any]]:
    """The window with the summary prompt after it: appended to its last user message (after any
    tool results, as the API wants them first) or as a user message of its own after an assistant one.
    ``shrink`` cuts long tool results and texts (for a window the API refused as too long to summarize
    whole), but not the summary the window starts from: it is all the run knows of what came before it,
    and no longer than ``summary_max_tokens``."""
    prompt = SUMMARY_PROMPT + (f"\n\nAlso: {instructions}" if instructions else "")
    messages = list(window)
    if shrink:
        messages = [m if i == 0 and _is_summary(m) else _shrunk(m) for i, m in enumerate(messages)]
    last = messages[-1]
    if last["role"] == "user":
        content = last["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        messages[-1] = {"role": "user", "content": [*blocks, {"type": "text", "text": prompt}]}
    else:
        messages.append({"role": "user", "content": [{"type": "text", "text": prompt}]})
    return messages


SHRUNK_RESULT_CHARS = 2000


def _is_summary(message: dict[str, Any]) -> bool:
    """A summary agentpool's compaction saved (the message a window starts from)."""
    content = message["content"]
    first = content[0] if isinstance(content, list) and content else None
    return (
        message["role"] == "user"
        and isinstance(first, dict)
        and first.get("type") == "text"
        and str(first.get("text", "")).startswith(SUMMARY_PREAMBLE)
    )


def _shrunk(message: dict[str, Any]) -> dict[str, Any]:
    """The message with long tool results (and long texts of the model's) cut, and without thinking
    blocks (the summary request has thinking off, so they may go, and with them any question of their
    signatures over what was cut): what a summary needs."""
    content = message["content"]
    if isinstance(content, str):  # a message sent as a plain string: one text block, cut as one
        content = [{"type": "text", "text": content}]
    blocks = []
    for block in content:
        if block.get("type") in ("thinking", "redacted_thinking"):
            continue
        key = {"tool_result": "content", "text": "text"}.get(block.get("type"))
        body = block.get(key) if key else None
        if key and isinstance(body, str) and len(body) > SHRUNK_RESULT_CHARS:
            cut = len(body) - SHRUNK_RESULT_CHARS
            block = {**block, key: f"{body[:SHRUNK_RESULT_CHARS]} [... {cut} characters cut]"}
        blocks.append(block)
    return {"role": message["role"], "content": blocks or [{"type": "text", "text": "(thinking)"}]}


def _continuable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The window as sent when it ends with the model's own reply (after ``max_tokens`` or
    ``pause_turn`` the request continues from it): the API refuses a final assistant message that ends
    in whitespace ("final assistant content cannot end with trailing whitespace") or in a thinking
    block ("The final block in an assistant message cannot be `thinking`"), so the copy sent drops
    trailing thinking blocks and trailing whitespace, and a text block left empty. Only the request
    changes: the stored reply stays byte-identical (the prompt cache reads the prefix byte for byte,
    and once it is no longer last it is sent whole)."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        return messages
    content = last["content"]
    if isinstance(content, str):
        kept: Any = content.rstrip() or []
    else:
        kept = list(content)
        while kept and kept[-1].get("type") in ("thinking", "redacted_thinking", "text"):
            block = kept[-1]
            if block["type"] != "text":
                kept.pop()
                continue
            text = block["text"].rstrip()
            if text:
                kept[-1] = {**block, "text": text}
                break
            kept.pop()
    if kept == content:
        return messages
    # Left empty (a reply cut inside its thinking), it stays: the API takes an empty final assistant
    # message, and the model starts its reply afresh.
    return [*messages[:-1], {"role": "assistant", "content": kept}]


def _with_moving_breakpoint(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        return messages
    last = copy.deepcopy(messages[-1])
    content = last["content"]
    if isinstance(content, str):
        last["content"] = [{"type": "text", "text": content, "cache_control": CACHE}]
    elif content and content[-1].get("type") not in ("thinking", "redacted_thinking"):
        content[-1] = {**content[-1], "cache_control": CACHE}
    return [*messages[:-1], last]


def call_model(
    agent: Agent,
    messages: list[dict[str, Any]],
    *,
    summary: bool = False,
    shrink: bool = False,
    live: DeltaSink | None = None,
    on_start: OnStart | None = None,
) -> ModelReply:
    """One call on the window ``messages`` (a ``summary`` call: agentpool's compaction, of a window with
    its long tool results cut when ``shrink``), streamed to ``live`` as it arrives; ``on_start`` is told
    the API's id for the call and its usage so far once its reply begins (a streamed call's
    ``message_start``: it is billed from there). Raises
    ModelUnavailable (transient), ModelQuotaExhausted, ContextTooLong or ModelRejected."""
    request = build_request(agent, messages, summary=summary, shrink=shrink)
    client, settings = _client()
    api = client.base_url  # the API or the gateway (ANTHROPIC_BASE_URL) the call goes to
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": agent.model,
        "gen_ai.request.max_tokens": request["max_tokens"],
        "gen_ai.request.stream": True if settings.model_streaming else None,
        "server.address": api.host,
        "server.port": api.port or (443 if api.scheme == "https" else 80),
        "agentpool.call.purpose": "summary" if summary else "reply",
    }
    with tracing.span(f"chat {agent.model}", client=True, **attributes) as span:
        reply = _call(request, live, on_start)
        tracing.set_attributes(
            span,
            **{
                "gen_ai.response.id": reply.meta.get("id"),
                "gen_ai.response.model": reply.meta.get("model"),
                "gen_ai.response.finish_reasons": [reply.stop_reason],
                # The conventions' input tokens include the cached ones, which Anthropic counts apart.
                "gen_ai.usage.input_tokens": sum(
                    reply.usage.get(k, 0)
                    for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
                ),
                "gen_ai.usage.output_tokens": reply.usage.get("output_tokens", 0),
                "gen_ai.usage.cache_read.input_tokens": reply.usage.get("cache_read_input_tokens", 0),
                "gen_ai.usage.cache_creation.input_tokens": reply.usage.get("cache_creation_input_tokens", 0),
                "agentpool.compacted": reply.compacted or None,  # the API compacted before answering
            },
        )
        return reply


def _call(request: dict[str, Any], live: DeltaSink | None, on_start: OnStart | None = None) -> ModelReply:
    client, settings = _client()
    started = time.monotonic()
    headers: dict[str, str] = {}
    try:
        if settings.model_streaming:
            data = _streamed(
                client,
                request,
                live,
                deadline=started + settings.model_call_timeout,
                headers=headers,
                on_start=on_start,
            )
        else:
            data = _created(client, request, settings.model_call_timeout, headers)
    except ModelUnavailable as exc:
        exc.limits = exc.limits or headers
        raise
    except anthropic.APIConnectionError as exc:  # includes APITimeoutError
        raise ModelUnavailable(f"model unreachable: {type(exc).__name__}: {exc}") from exc
    except anthropic.APIStatusError as exc:
        raise _classify(exc) from exc
    usage = _billed(data.get("usage") or {})
    meta = {k: data.get(k) for k in ("id", "model", "stop_reason", "stop_sequence")}
    meta["usage"] = usage
    # How big the conversation is now: what the next request starts from (agentpool's compaction trigger).
    sampled = data.get("usage") or {}
    meta["context_tokens"] = sum(int(sampled.get(k) or 0) for k in USAGE_FIELDS)
    content = data["content"]
    compacted = bool(content) and content[0].get("type") == "compaction" and content[0].get("content") is not None
    if compacted:
        meta["compacted"] = True
    return ModelReply(
        message={"role": "assistant", "content": content},
        stop_reason=str(data.get("stop_reason") or "end_turn"),
        usage=usage,
        meta=meta,
        seconds=time.monotonic() - started,
        compacted=compacted,
        limits=headers,
    )


RATE_LIMIT_HEADER = "anthropic-ratelimit-"


def rate_limit_headers(headers: Any) -> dict[str, str]:
    """The ``anthropic-ratelimit-*`` headers of a reply (what the pool's budget learns from)."""
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith(RATE_LIMIT_HEADER)}


def _created(
    client: anthropic.Anthropic, request: dict[str, Any], cap: float, headers: dict[str, str]
) -> dict[str, Any]:
    betas = request.pop("betas", None)
    api: Any = client.beta.messages if betas else client.messages
    raw = api.with_raw_response.create(**request, **({"betas": betas} if betas else {}), timeout=cap)
    headers.update(rate_limit_headers(raw.headers))
    return raw.parse().to_dict(mode="json")  # type: ignore[no-any-return]


def _streamed(
    client: anthropic.Anthropic,
    request: dict[str, Any],
    live: DeltaSink | None,
    *,
    deadline: float,
    headers: dict[str, str],
    on_start: OnStart | None = None,
) -> dict[str, Any]:
    """A streamed call, read from its events as plain JSON (``agentpool.runtime.reply_stream``: the
    SDK's typed stream cost the worker a fifth more than a ``create()``); the request, its status
    errors and the transport are the SDK's."""
    betas = request.pop("betas", None)
    api: Any = client.beta.messages if betas else client.messages
    reply = Reply()
    outcome = "cut"
    try:
        with api.with_streaming_response.create(**request, stream=True, **({"betas": betas} if betas else {})) as raw:
            headers.update(rate_limit_headers(raw.headers))
            for event in events(raw.iter_lines()):
                reply.add(event)
                if on_start is not None and event["type"] == "message_start" and reply.message is not None:
                    on_start(str(reply.message.get("id") or ""), dict(reply.spent))
                if live is not None and event["type"] in ("content_block_start", "content_block_delta"):
                    _forward(live, event)
                if time.monotonic() > deadline:
                    raise ModelUnavailable(
                        "the call ran past AGENTPOOL_MODEL_CALL_TIMEOUT", kind="timeout", spent=reply.spent
                    )
        if not reply.finished or reply.message is None:
            raise ModelUnavailable("the stream ended before message_stop", spent=reply.spent)
        outcome = "complete"
        return reply.message
    except StreamError as exc:  # an `error` event after the 200
        if exc.kind in _FINAL_ERROR_TYPES:
            raise ModelRejected(f"{exc.kind} during the stream: {exc.message}", spent=reply.spent) from exc
        raise ModelUnavailable(
            f"{exc.kind} during the stream: {exc.message}", kind=exc.kind, spent=reply.spent
        ) from exc
    # The SDK (2.17 and later) wraps a failure to read the body in APITimeoutError or APIConnectionError;
    # earlier ones let httpx's own error through. Either way the tokens message_start reported were billed.
    except (httpx2.TimeoutException, anthropic.APITimeoutError) as exc:
        raise ModelUnavailable(
            f"the stream went silent past AGENTPOOL_MODEL_TIMEOUT ({_cause_name(exc)})",
            kind="timeout",
            spent=reply.spent,
        ) from exc
    except (httpx2.TransportError, httpx2.DecodingError, anthropic.APIConnectionError) as exc:
        raise ModelUnavailable(f"the stream was cut: {_cause_name(exc)}: {exc}", spent=reply.spent) from exc
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # an event that is not what the API sends
        raise ModelUnavailable(f"the stream sent an unreadable event: {exc!r}"[:500], spent=reply.spent) from exc
    finally:
        if live is not None:
            live.close(outcome)


def _cause_name(exc: BaseException) -> str:
    """The transport error's own name under the SDK's wrapper (``RemoteProtocolError``, ``ReadTimeout``)."""
    return type(exc.__cause__ or exc).__name__


def _forward(live: DeltaSink, event: dict[str, Any]) -> None:
    index = event["index"]
    if event["type"] == "content_block_start":
        block = event["content_block"]
        live.block_start(index, block["type"], block.get("name"))
        return
    delta = event["delta"]
    kind = delta.get("type")
    if kind == "text_delta":
        live.delta(index, "text_delta", delta["text"])
    elif kind == "thinking_delta":
        live.delta(index, "thinking_delta", delta["thinking"])
    elif kind == "input_json_delta":
        live.delta(index, "input_json_delta", delta["partial_json"])


def _billed(usage: dict[str, Any]) -> dict[str, int]:
    """Every token of the call: the top-level usage and a server-side compaction's, which the API reports
    in ``usage.iterations`` only (anthropic/types/beta/beta_iterations_usage.py)."""
    billed = {name: int(usage.get(name) or 0) for name in USAGE_FIELDS}
    for step in usage.get("iterations") or []:
        if isinstance(step, dict) and step.get("type") == "compaction":
            for name in USAGE_FIELDS:
                billed[name] += int(step.get(name) or 0)
    return billed


def _error_parts(exc: anthropic.APIStatusError) -> tuple[str, str]:
    """(the API's error type, its message), from the error body when it has the API's shape."""
    body = exc.body if isinstance(exc.body, dict) else {}
    err = body.get("error") if isinstance(body.get("error"), dict) else body
    if not isinstance(err, dict):
        return f"http_{exc.status_code}", str(exc)
    kind = str(err.get("type") or "")
    # The type becomes a metrics label: only what the API's types look like, not what a gateway says.
    kind = kind if re.fullmatch(r"[a-z][a-z0-9_]{0,39}", kind) else f"http_{exc.status_code}"
    return kind, str(err.get("message") or exc)


def _retry_after(exc: anthropic.APIStatusError) -> float | None:
    headers = exc.response.headers
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return float(value) * scale
            except ValueError:
                return None
    return None


def _classify(exc: anthropic.APIStatusError) -> AgentPoolError:
    kind, message = _error_parts(exc)
    status = exc.status_code
    text = f"{status} {kind}: {message}"
    if status == 400 and "prompt is too long" in message.lower():
        return ContextTooLong(text)
    if status == 429 and any(words in text.lower() for words in _NON_TRANSIENT_429):
        return ModelQuotaExhausted(f"the API refused for a limit that waiting will not clear: {text}")
    if status in (408, 409, 429) or status >= 500:
        headers = rate_limit_headers(exc.response.headers)
        return ModelUnavailable(text, _retry_after(exc), kind=kind, limits=headers, status=status)
    return ModelRejected(text)
