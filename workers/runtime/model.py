"""The model adapter: the only module that imports ``anthropic``.

The client is configured from the environment as the SDK does (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL).
The SDK's own retries are off: it honours ``retry-after`` without a cap, which would park a worker for
as long as the API asks. Transient errors instead come back as ``ModelUnavailable`` and the turn is
retried later through RQ's scheduler, so no worker sleeps.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import anthropic

from agentpool.agent import Agent
from agentpool.store.errors import AgentPoolError

CACHE = {"type": "ephemeral"}
# 429 bodies that will not clear by waiting (a spend or credit limit), by the words the API uses.
_NON_TRANSIENT_429 = ("usage limit", "spend limit", "credit balance", "billing")


class ModelUnavailable(AgentPoolError):
    """A transient failure (429, 529, 5xx, timeout, connection): try the same turn again later."""

    retryable = True

    def __init__(self, message: str, retry_after: float | None = None, kind: str = "connection") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.kind = kind  # the API's error type (rate_limit_error, overloaded_error, ...) or "connection"


class ModelRejected(AgentPoolError):
    """The API refused the request and retrying cannot help (400-class): the run fails."""


class ModelQuotaExhausted(AgentPoolError):
    """A 429 caused by a spend or credit limit: the run stops, resumable once the limit is raised."""


@dataclass(frozen=True)
class ModelReply:
    message: dict[str, Any]  # {"role": "assistant", "content": [...]} as the API returned it
    stop_reason: str
    usage: dict[str, int]
    meta: dict[str, Any]  # response id, model, stop_reason, usage: kept beside the message


_clients: dict[int, anthropic.Anthropic] = {}


def _client() -> anthropic.Anthropic:
    # One client per process: an httpx pool must not cross a fork into a work horse.
    pid = os.getpid()
    if pid not in _clients:
        timeout = float(os.environ.get("AGENTPOOL_MODEL_TIMEOUT", "600"))
        _clients[pid] = anthropic.Anthropic(max_retries=0, timeout=timeout)
    return _clients[pid]


def warm_up() -> None:
    """Do the SDK's lazy one-time work (imports, building the response model's validators) in a
    process that forks work horses, so each horse does not pay ~200 ms for it on every turn. No
    client or connection is kept: an HTTP pool must not cross a fork."""
    anthropic.Anthropic(api_key="warm-up", max_retries=0).close()
    anthropic.types.Message.model_validate(
        {
            "id": "msg_warm_up",
            "type": "message",
            "role": "assistant",
            "model": "warm-up",
            "content": [
                {"type": "text", "text": ""},
                {"type": "tool_use", "id": "toolu_warm_up", "name": "t", "input": {}},
            ],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
    )


def build_request(agent: Agent, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The request, with cache breakpoints on the tools, the system prompt and the last message.

    The breakpoint on the last message moves every turn and is added to a copy here, never stored, so
    the stored history stays byte-identical and a run resumed elsewhere reads its prefix from the cache.
    """
    tools = [t.to_param() for t in agent.tools]
    if tools:
        tools[-1] = {**tools[-1], "cache_control": CACHE}
    request: dict[str, Any] = {
        "model": agent.model,
        "max_tokens": agent.max_tokens,
        "messages": _with_moving_breakpoint(messages),
        **agent.model_options,
    }
    if tools:
        request["tools"] = tools
    if agent.system:
        request["system"] = [{"type": "text", "text": agent.system, "cache_control": CACHE}]
    return request


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


def call_model(agent: Agent, messages: list[dict[str, Any]]) -> ModelReply:
    try:
        response = _client().messages.create(**build_request(agent, messages))
    except anthropic.APIConnectionError as exc:  # includes APITimeoutError
        raise ModelUnavailable(f"model unreachable: {type(exc).__name__}: {exc}") from exc
    except anthropic.APIStatusError as exc:
        raise _classify(exc) from exc
    data = response.to_dict(mode="json")
    usage = {
        k: int(v or 0)
        for k, v in (data.get("usage") or {}).items()
        if k.endswith("_tokens") and isinstance(v, int | None)
    }
    meta = {k: data.get(k) for k in ("id", "model", "stop_reason", "stop_sequence")}
    meta["usage"] = usage
    return ModelReply(
        message={"role": "assistant", "content": data["content"]},
        stop_reason=str(data.get("stop_reason") or "end_turn"),
        usage=usage,
        meta=meta,
    )


def _error_parts(exc: anthropic.APIStatusError) -> tuple[str, str]:
    """(the API's error type, its message), from the error body when it has the API's shape."""
    body = exc.body if isinstance(exc.body, dict) else {}
    err = body.get("error") if isinstance(body.get("error"), dict) else body
    if not isinstance(err, dict):
        return f"http_{exc.status_code}", str(exc)
    return str(err.get("type") or f"http_{exc.status_code}"), str(err.get("message") or exc)


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
    if status == 429 and any(words in text.lower() for words in _NON_TRANSIENT_429):
        return ModelQuotaExhausted(f"the API refused for a limit that waiting will not clear: {text}")
    if status in (408, 409, 429) or status >= 500:
        return ModelUnavailable(text, _retry_after(exc), kind=kind)
    return ModelRejected(text)
