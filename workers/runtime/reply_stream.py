"""A streamed reply read from its server-sent events, into the message a non-streaming call returns.

The SDK's ``messages.stream()`` builds a typed event object per event and a typed snapshot of the
whole message after each one, re-parsing a tool's partial input JSON at every delta: on a turn with a
trivial model call that was most of what streaming cost the worker over one ``create()`` (measured by
``agentpool bench --only overhead``). Here the events are plain JSON: each is decoded once, the reply
is accumulated in plain dicts (text, thinking and signatures appended, a tool's input JSON joined and
parsed once at its block's end) exactly as the SDK's accumulation does it (``accumulate_event`` in
``anthropic/lib/streaming/_messages.py`` and ``_beta_messages.py``), and the message is what the API
sent, field for field.

Only the parsing lives here; the request, its errors and the transport are the SDK's
(``agentpool.runtime.model``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jiter

from agentpool.store.records import USAGE_FIELDS

CUT_STOPS = ("max_tokens", "model_context_window_exceeded")  # replies the API ends midway


class StreamError(Exception):
    """An ``error`` event after the 200: ``kind`` is the API's error type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON of each server-sent event (its ``data``, its lines joined), ``ping`` included: the
    caller's cap on the whole call is checked at every event, and a stream that only pings (a step
    stuck on the API's side) must reach it too."""
    data: list[str] = []
    for line in lines:
        if line:
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value.removeprefix(" "))
            continue  # "event:", comments and other fields: the type is in the data too
        if data:
            event = json.loads("\n".join(data))
            data = []
            yield event
    if data:
        yield json.loads("\n".join(data))


class Reply:
    """The message so far, and the usage the API reported so far (billed even if the stream is cut)."""

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.spent: dict[str, int] = {}
        self.finished = False
        self._input_json: dict[int, str] = {}
        self._partial_inputs: list[int] = []  # blocks whose input JSON ended before it was whole

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "ping":
            return
        if kind == "content_block_delta":
            self._delta(event["index"], event["delta"])
        elif kind == "content_block_start":
            block = event["content_block"]
            self._content().append(block)
            if block.get("type") == "fallback":  # the hop that served the reply names the model (beta)
                self._message()["model"] = block.get("to", {}).get("model", self._message().get("model"))
        elif kind == "content_block_stop":
            joined = self._input_json.pop(event["index"], None)
            if joined:
                self._content()[event["index"]]["input"] = self._input(event["index"], joined)
        elif kind == "message_start":
            self.message = event["message"]
            self._tally(self.message.get("usage") or {})
        elif kind == "message_delta":
            self._message_delta(event)
        elif kind == "message_stop":
            cut = self._message().get("stop_reason") in CUT_STOPS
            if self._partial_inputs and not cut:
                raise ValueError(
                    f"a tool_use's input is not whole JSON though the reply was not cut: {self._partial_inputs}"
                )
            self.finished = True
        elif kind == "error":
            err = event.get("error") if isinstance(event.get("error"), dict) else {}
            raise StreamError(str(err.get("type") or "error"), str(err.get("message") or event))

    def _input(self, index: int, joined: str) -> Any:
        """A tool's input from its joined JSON. A reply cut by ``max_tokens`` (or the context window)
        ends a tool_use's JSON midway: kept as far as it parses, as the SDK's accumulation does (the
        turn answers that call as not run); whole JSON is required of any other reply (``message_stop``)."""
        try:
            return json.loads(joined)
        except ValueError:
            self._partial_inputs.append(index)
            return jiter.from_json(joined.encode(), partial_mode=True)

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self._content()[index]
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta["text"]
        elif kind == "input_json_delta":
            self._input_json[index] = self._input_json.get(index, "") + delta["partial_json"]
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "citations_delta":
            block["citations"] = [*(block.get("citations") or []), delta["citation"]]
        elif kind == "compaction_delta":
            block["content"] = delta.get("content")
            block["encrypted_content"] = delta.get("encrypted_content")

    def _message_delta(self, event: dict[str, Any]) -> None:
        message, delta = self._message(), event.get("delta") or {}
        for name in ("stop_reason", "stop_sequence", "stop_details"):
            if name in delta:
                message[name] = delta[name]
        if delta.get("container") is not None:
            message["container"] = delta["container"]
        for name in ("context_management", "input_transformations"):
            if event.get(name) is not None:
                message[name] = event[name]
        # A message_delta's usage is cumulative: it overwrites; a count it leaves out keeps its value.
        usage = event.get("usage") or {}
        message.setdefault("usage", {}).update({k: v for k, v in usage.items() if v is not None})
        self._tally(usage)

    def _tally(self, usage: dict[str, Any]) -> None:
        for name in USAGE_FIELDS:
            if usage.get(name) is not None:
                self.spent[name] = int(usage[name])

    def _message(self) -> dict[str, Any]:
        if self.message is None:
            raise StreamError("invalid_stream", "an event came before message_start")
        return self.message

    def _content(self) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = self._message().setdefault("content", [])
        return content
