"""The answer to one ``POST /v1/messages``: validated as the API validates it, compacted when its edits
ask for it, fitted to the context window, with the usage the API would report."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

from agentpool.testing.scripted_model.cache import PromptCache
from agentpool.testing.scripted_model.common import (
    ERROR_TYPE_BY_STATUS,
    ApiError,
    canonical,
    estimate_tokens,
    random_id,
)
from agentpool.testing.scripted_model.compaction import (
    Edits,
    check_prompt_fits,
    clear_tool_uses,
    fit_output,
    is_summary_request,
    make_block,
    parse_edits,
    step_view,
    summary_text,
)
from agentpool.testing.scripted_model.ratelimit import Admission, RateLimiter
from agentpool.testing.scripted_model.scripts import (
    STOP_SEQUENCE,
    InjectedError,
    ScriptBook,
    build_content,
    first_user_text,
)
from agentpool.testing.scripted_model.validation import validate_request


@dataclass
class Answer:
    message: dict[str, Any]  # the Message, as a non-streaming response returns it
    script: str
    stream: dict[str, Any] = field(default_factory=dict)  # the step's stream options
    cut: dict[str, Any] | None = None  # the cut this stream gets, if one is due
    kind: str = "response"  # "response", "summary" (a client's summary request), "compaction" (paused after one)
    compacted: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # the rate-limit headers of the reply


class Occurrences:
    """How often a scripted fault fired, per (conversation, script, step, what): the first ``times`` fire."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits: dict[tuple[str, ...], int] = {}

    def due(self, first_text: str, name: str, index: int, what: str, times: int) -> bool:
        key = (hashlib.sha256(first_text.encode()).hexdigest(), name, str(index), what)
        with self._lock:
            served = self._hits.get(key, 0)
            if served >= times:
                return False
            self._hits[key] = served + 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._hits.clear()


def _injected(spec: dict[str, Any]) -> InjectedError:
    status = int(spec["status"])
    headers = {"x-should-retry": "false"}
    if spec.get("retry_after") is not None:
        headers["retry-after"] = str(spec["retry_after"])
    kind = spec.get("type") or ERROR_TYPE_BY_STATUS.get(status, "api_error")
    return InjectedError(ApiError(status, kind, spec.get("message") or f"Injected error {status}", headers))


class Answerer:
    """Answers requests from a script book, a prompt cache and a context window of ``window`` tokens."""

    def __init__(
        self, book: ScriptBook, cache: PromptCache, lock: threading.Lock, window: int, limiter: RateLimiter
    ) -> None:
        self.book, self.cache, self.lock, self.window = book, cache, lock, window
        self.limiter = limiter
        self.faults = Occurrences()

    def answer(self, body: Any, betas: frozenset[str], streaming: bool) -> Answer:
        state = validate_request(body, betas)
        edits = parse_edits(body, betas)
        admission = self._admit(body)
        try:
            answer = self._answer(body, betas, streaming, state, edits)
        except (ApiError, InjectedError) as exc:
            admission.settle(0)  # nothing was sampled: the output estimate goes back
            error = exc.error if isinstance(exc, InjectedError) else exc
            error.headers = {**admission.headers, **error.headers}
            raise
        admission.settle(int(answer.message["usage"].get("output_tokens") or 0))
        answer.headers = admission.headers
        return answer

    def _admit(self, body: dict[str, Any]) -> Admission:
        """The request through the rate limits (a 429 beyond them): cache reads do not count as input."""
        with self.lock:
            usage = self.cache.usage(body, record=False)
        counted = usage["input_tokens"] + usage["cache_creation_input_tokens"]
        return self.limiter.admit(counted, int(body["max_tokens"]))

    def _answer(self, body: Any, betas: frozenset[str], streaming: bool, state: Any, edits: Edits) -> Answer:
        view = {**body, "messages": step_view(body["messages"], state)}
        sent, applied = body, None
        with self.lock:
            usage = self.cache.usage(body)
            if edits.clear_tool_uses is not None:
                sent, applied = clear_tool_uses(body, edits.clear_tool_uses, sum(usage.values()))
                if applied is not None:
                    usage = self.cache.usage(sent)
        if is_summary_request(body["messages"]):
            return self._summary(body, view, usage)
        compaction = self._compaction(body, view, edits, usage)
        if compaction is not None:
            block, usage, iterations = compaction
            if edits.compact and edits.compact["pause"]:
                check_prompt_fits(sum(usage.values()), self.window)
                return self._reply(body, "compaction", [block], "compaction", usage, iterations, kind="compaction")
        check_prompt_fits(sum(usage.values()), self.window)
        name, _index, step = self.book.step_for(view)  # the step's delay and injected error happen here
        content = build_content(step, {t.get("name") for t in body.get("tools") or []})
        stop = step.get("stop_reason") or ("tool_use" if step.get("tool_calls") else "end_turn")
        if compaction is not None:
            content = [compaction[0], *content]
        answer = self._reply(
            body, name, content, stop, usage, compaction[2] if compaction else None, overrides=step.get("usage")
        )
        answer.compacted = compaction is not None
        if applied is not None:
            answer.message["context_management"] = applied
        if streaming:
            self._script_stream(answer, view, name, step)
        return answer

    def _compaction(
        self, body: dict[str, Any], view: dict[str, Any], edits: Edits, usage: dict[str, int]
    ) -> tuple[dict[str, Any], dict[str, int], list[dict[str, Any]]] | None:
        """Server-side compaction when the edit's trigger is passed: (block, the usage of the sampling
        that follows it, the iterations)."""
        if edits.compact is None or sum(usage.values()) < edits.compact["trigger"]:
            return None
        if body["messages"][-1]["role"] != "user":
            return None  # a turn in progress is not compacted; the next request will be
        name, index, _step = self.book.peek(view)
        summary = summary_text(name, index, view["messages"], edits.compact.get("instructions"))
        block = make_block(summary, first_text=first_user_text(view["messages"]), turns=index)
        after = {
            "model": body["model"],
            "tools": body.get("tools") or [],
            "system": body.get("system") or "",
            "messages": [{"role": "assistant", "content": [block]}],
        }
        with self.lock:
            sampled = self.cache.usage(after)
        compacting = {**usage, "output_tokens": estimate_tokens(summary), "type": "compaction"}
        return block, sampled, [compacting, {**sampled, "output_tokens": 0, "type": "message"}]

    def _summary(self, body: dict[str, Any], view: dict[str, Any], usage: dict[str, int]) -> Answer:
        check_prompt_fits(sum(usage.values()), self.window)
        name, index, step = self.book.peek(view)
        options = step.get("summary") or {}
        first = first_user_text(view["messages"])
        spec = options.get("error")
        if spec and self.faults.due(first, name, index, "summary-error", int(spec.get("times", 1))):
            raise _injected(spec)
        # The request ends with the summary instruction: the conversation is what comes before it.
        text = summary_text(name, index, view["messages"], options.get("text"))
        stop, longest = "end_turn", body["max_tokens"] * 4  # estimate_tokens' 4 characters a token
        if len(text) > longest:  # as the API's, the reply ends at max_tokens (the markers come first)
            text, stop = text[:longest], "max_tokens"
        answer = self._reply(body, name, [{"type": "text", "text": text}], stop, usage, None, kind="summary")
        stream = options.get("stream") or {}
        answer.stream = stream
        cut = stream.get("cut")
        if cut and self.faults.due(first, name, index, "summary-cut", int(cut.get("times", 1))):
            answer.cut = cut
        return answer

    def _script_stream(self, answer: Answer, view: dict[str, Any], name: str, step: dict[str, Any]) -> None:
        answer.stream = step.get("stream") or {}
        cut = answer.stream.get("cut")
        index = sum(1 for m in view["messages"] if m["role"] == "assistant")
        if cut and self.faults.due(first_user_text(view["messages"]), name, index, "cut", int(cut.get("times", 1))):
            answer.cut = cut

    def _reply(
        self,
        body: dict[str, Any],
        name: str,
        content: list[dict[str, Any]],
        stop: str,
        usage: dict[str, int],
        iterations: list[dict[str, Any]] | None,
        *,
        overrides: dict[str, Any] | None = None,
        kind: str = "response",
    ) -> Answer:
        content, cut_by_window = fit_output(content, self.window - sum(usage.values()))
        if cut_by_window:
            stop = "model_context_window_exceeded"
        # A compaction block is the compaction step's output (its iteration), not this sampling's.
        sampled = [b for b in content if b["type"] != "compaction"]
        usage = {**usage, "output_tokens": estimate_tokens(canonical(sampled)) if sampled else 0}
        usage.update(overrides or {})
        if iterations:
            iterations[-1]["output_tokens"] = usage["output_tokens"]
            usage["iterations"] = iterations  # type: ignore[assignment]
        message = {
            "id": random_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop,
            "stop_sequence": STOP_SEQUENCE if stop == "stop_sequence" else None,
            "usage": usage,
        }
        return Answer(message, name, kind=kind)
