"""Streaming (``"stream": true``): the server-sent events the Messages API sends and the SDK parses
(``anthropic/_streaming.py``, ``anthropic/lib/streaming/``), and the faults a real stream has.

A response streams as ``message_start`` (the usage known before sampling), a ``ping``, for each content
block ``content_block_start`` / its deltas (``text_delta``, ``thinking_delta`` then ``signature_delta``,
``input_json_delta``, ``compaction_delta``) / ``content_block_stop``, then ``message_delta`` (stop
reason, cumulative usage) and ``message_stop``. Every event carries an ``event:`` line: the SDK skips
data without one. The body is chunked (HTTP/1.1 keep-alive), one chunk per event. A reply that stops at
``max_tokens`` with a tool_use last ends that tool's ``input_json_delta``s midway, as the API's does:
its input JSON is never whole.

A step's ``"stream"`` options script the stream::

    "stream": {"chunk": 8,            # characters per text/thinking/tool-input delta (default 24)
               "interval": 0.02,      # seconds between events (default 0)
               "pings": 3,            # ping events, the first right after message_start (default 1)
               "cut": {"after": 5,    # events sent before the cut (default: half of them)
                       "how": "error",  # "error": an `error` event after the 200, then the stream ends;
                                        # "drop": the connection is closed mid-body;
                                        # "stall": `seconds` of silence, then the rest;
                                        # "pings": `seconds` of pings only (one every 0.25 s), then the rest
                       "type": "overloaded_error", "message": "Overloaded", "seconds": 5,
                       "times": 1}}   # the first `times` streams of this step are cut (default 1)
"""

from __future__ import annotations

import json
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

STREAM_KEYS = frozenset({"chunk", "interval", "pings", "cut"})
CUT_KEYS = frozenset({"after", "how", "type", "message", "seconds", "times"})
CUT_HOWS = ("error", "drop", "stall", "pings")
DEFAULT_CHUNK = 24


def validate_stream_options(where: str, options: Any) -> None:
    """A scripted ``stream`` entry; a malformed one is a test bug and fails loudly (ValueError)."""
    if not isinstance(options, dict):
        raise ValueError(f"{where}: must be an object")
    unknown = sorted(set(options) - STREAM_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(STREAM_KEYS)}")
    for key in ("chunk", "pings"):
        if key in options and (not isinstance(options[key], int) or options[key] < (1 if key == "chunk" else 0)):
            raise ValueError(f"{where}.{key}: must be a {'positive' if key == 'chunk' else 'non-negative'} integer")
    if "interval" in options and (not isinstance(options["interval"], (int, float)) or options["interval"] < 0):
        raise ValueError(f"{where}.interval: must be a non-negative number of seconds")
    cut = options.get("cut")
    if cut is None:
        return
    if not isinstance(cut, dict):
        raise ValueError(f"{where}.cut: must be an object")
    unknown = sorted(set(cut) - CUT_KEYS)
    if unknown:
        raise ValueError(f"{where}.cut: unknown keys {unknown}; allowed: {sorted(CUT_KEYS)}")
    if cut.get("how", "error") not in CUT_HOWS:
        raise ValueError(f"{where}.cut.how: must be one of {list(CUT_HOWS)}")
    for key in ("after", "times"):
        if key in cut and (not isinstance(cut[key], int) or cut[key] < 1):
            raise ValueError(f"{where}.cut.{key}: must be a positive integer")


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or []


def _block_events(
    index: int, block: dict[str, Any], chunk: int, *, cut: bool = False
) -> list[tuple[str, dict[str, Any]]]:
    def start(shape: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_start", {"type": "content_block_start", "index": index, "content_block": shape}

    def delta(shape: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": shape}

    kind = block["type"]
    out: list[tuple[str, dict[str, Any]]] = []
    if kind == "text":
        out.append(start({"type": "text", "text": ""}))
        out += [delta({"type": "text_delta", "text": p}) for p in _pieces(block["text"], chunk)]
    elif kind == "thinking":
        out.append(start({"type": "thinking", "thinking": "", "signature": ""}))
        out += [delta({"type": "thinking_delta", "thinking": p}) for p in _pieces(block["thinking"], chunk)]
        out.append(delta({"type": "signature_delta", "signature": block["signature"]}))
    elif kind == "tool_use":
        out.append(start({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}))
        raw = json.dumps(block["input"], ensure_ascii=False)
        if cut and raw != "{}":
            # The reply ends at max_tokens inside this tool's input, as the API's does: its JSON stops
            # midway (never whole: the closing brace is always past the cut).
            raw = raw[: max(1, 2 * len(raw) // 3)]
        if raw != "{}":
            out += [delta({"type": "input_json_delta", "partial_json": p}) for p in _pieces(raw, chunk)]
    elif kind == "compaction":
        # The signature and tool changes come with the start; the summary in one delta, which the SDK
        # assigns (it does not append): the compaction was done before the response began.
        out.append(start({k: v for k, v in block.items() if k in ("type", "signature", "tool_changes")}))
        out.append(
            delta(
                {
                    "type": "compaction_delta",
                    "content": block.get("content"),
                    "encrypted_content": block.get("encrypted_content"),
                }
            )
        )
    else:
        raise ValueError(f"cannot stream a {kind!r} block")
    out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return out


def events(message: dict[str, Any], options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The events of a complete Message, in the API's order, pings interleaved."""
    usage = message["usage"]
    inputs = {k: v for k, v in usage.items() if k != "output_tokens" and k != "iterations"}
    start = {
        **{k: message[k] for k in ("id", "type", "role", "model")},
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**inputs, "output_tokens": min(1, usage["output_tokens"])},
    }
    body: list[tuple[str, dict[str, Any]]] = []
    content = message["content"]
    cut = message["stop_reason"] == "max_tokens" and bool(content) and content[-1]["type"] == "tool_use"
    for i, block in enumerate(content):
        body += _block_events(i, block, int(options.get("chunk", DEFAULT_CHUNK)), cut=cut and i == len(content) - 1)
    end: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
        "usage": dict(usage),  # cumulative: the SDK overwrites its snapshot with these
    }
    if message.get("context_management") is not None:
        end["context_management"] = message["context_management"]
    body += [("message_delta", end), ("message_stop", {"type": "message_stop"})]
    pings = int(options.get("pings", 1))
    out: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    if pings:
        out.append(("ping", {"type": "ping"}))
        every = max(1, len(body) // pings) if pings > 1 else 0
        for n, event in enumerate(body, 1):
            out.append(event)
            if every and n % every == 0 and n < len(body):
                out.append(("ping", {"type": "ping"}))
        return out
    return out + body


class StreamWriter:
    """Writes one SSE response on a request handler's connection, chunked, and applies a scripted cut."""

    def __init__(
        self,
        handler: Any,
        request_id: str,
        on_text: Callable[[str], None] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.handler, self.request_id, self.on_text = handler, request_id, on_text
        self.headers = headers or {}

    def _write(self, data: bytes) -> bool:
        try:
            self.handler.wfile.write(data)
            return True
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.handler.close_connection = True
            return False  # the client gave up (its idle timeout, a cancelled call)

    def _chunk(self, name: str, payload: dict[str, Any]) -> bytes:
        # ASCII JSON (\uXXXX escapes), as any JSON encoder may send: text the API would carry as an
        # escape (a lone surrogate among them) cannot break the encoding of the stream.
        data = f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()
        return b"%x\r\n%s\r\n" % (len(data), data)

    def _event(self, name: str, payload: dict[str, Any]) -> bool:
        ok = self._write(self._chunk(name, payload))
        if ok and self.on_text and name == "content_block_delta" and payload["delta"]["type"] == "text_delta":
            self.on_text(payload["delta"]["text"])
        return ok

    def send(self, message: dict[str, Any], options: dict[str, Any], cut: dict[str, Any] | None) -> str:
        """Stream ``message``; returns "complete", or how the stream was cut."""
        handler = self.handler
        try:
            handler.send_response(200)
            handler.send_header("content-type", "text/event-stream; charset=utf-8")
            handler.send_header("cache-control", "no-cache")
            handler.send_header("transfer-encoding", "chunked")
            handler.send_header("request-id", self.request_id)
            for name, value in self.headers.items():
                handler.send_header(name, value)
            handler.end_headers()
        except OSError:
            handler.close_connection = True
            return "client gone"
        stream = events(message, options)
        cut_at = int(cut.get("after", max(2, len(stream) // 2))) if cut else -1
        interval = float(options.get("interval", 0))
        if not interval and cut is None:
            # A model that answers at once: every event in one write, as a socket would coalesce them.
            body = b"".join(self._chunk(name, payload) for name, payload in stream)
            for name, payload in stream:
                if self.on_text and name == "content_block_delta" and payload["delta"]["type"] == "text_delta":
                    self.on_text(payload["delta"]["text"])
            return "complete" if self._write(body + b"0\r\n\r\n") else "client gone"
        for n, (name, payload) in enumerate(stream):
            if n == cut_at and cut is not None:
                return self._cut(cut, stream[n:], interval)
            if interval and n:
                time.sleep(interval)
            if not self._event(name, payload):
                return "client gone"
        self._write(b"0\r\n\r\n")
        return "complete"

    def _cut(self, cut: dict[str, Any], rest: list[tuple[str, dict[str, Any]]], interval: float) -> str:
        how = cut.get("how", "error")
        if how == "error":
            kind = cut.get("type", "overloaded_error")
            self._event(
                "error", {"type": "error", "error": {"type": kind, "message": cut.get("message", "Overloaded")}}
            )
            self._write(b"0\r\n\r\n")
            return "error"
        if how == "drop":
            self.handler.close_connection = True
            try:
                self.handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return "drop"
        if how == "pings":  # alive but saying nothing (a step stuck on the API's side): only the call's cap ends it
            until = time.monotonic() + float(cut.get("seconds", 5))
            while time.monotonic() < until:
                if not self._event("ping", {"type": "ping"}):
                    return "client gone"
                time.sleep(0.25)
        else:
            time.sleep(float(cut.get("seconds", 5)))  # stall: the client's idle timeout should fire meanwhile
        for name, payload in rest:
            if interval:
                time.sleep(interval)
            if not self._event(name, payload):
                return "stall"
        self._write(b"0\r\n\r\n")
        return "stall"


class DeltaLog:
    """When each text delta left the server (``time.monotonic()``): for measuring how fast it reaches a watcher."""

    def __init__(self, size: int = 20_000) -> None:
        self._log: deque[tuple[float, str]] = deque(maxlen=size)

    def add(self, text: str) -> None:
        self._log.append((time.monotonic(), text))

    def items(self) -> list[tuple[float, str]]:
        return list(self._log)

    def clear(self) -> None:
        self._log.clear()
