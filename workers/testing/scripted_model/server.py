"""The scripted model's HTTP server: ``ScriptedModel`` serves ``POST /v1/messages`` from a ``ScriptBook``,
validating each request as the API does, and a few endpoints of its own for tests."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, Self

from agentpool.testing.scripted_model.answer import Answer, Answerer
from agentpool.testing.scripted_model.cache import PromptCache
from agentpool.testing.scripted_model.common import ApiError, error_body, invalid, parse_json, random_id
from agentpool.testing.scripted_model.compaction import DEFAULT_CONTEXT_WINDOW, betas_of
from agentpool.testing.scripted_model.ratelimit import RateLimiter, RateLimits
from agentpool.testing.scripted_model.scripts import InjectedError, ScriptBook
from agentpool.testing.scripted_model.sse import DeltaLog, StreamWriter

MAX_REJECTIONS_KEPT = 50
MAX_REQUEST_SIZES_KEPT = 10_000
TOKEN_KINDS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], model: ScriptedModel) -> None:
        self.model = model
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    # Track keep-alive connections so stop() can close them: otherwise a client's pooled connection
    # would keep being served by a handler thread after the server "stopped".
    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away (a SIGKILLed worker resets its keep-alive connection) is no error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real API; every reply sets Content-Length
    disable_nagle_algorithm = True  # else Nagle + delayed ACK add ~40 ms to every reply
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests and the demo run many requests; /_stats is the way to look inside

    def do_GET(self) -> None:
        self.server.model._dispatch(self, "GET")

    def do_POST(self) -> None:
        self.server.model._dispatch(self, "POST")

    def do_PUT(self) -> None:
        self.server.model._dispatch(self, "PUT")

    def do_DELETE(self) -> None:
        self.server.model._dispatch(self, "DELETE")

    def do_PATCH(self) -> None:
        self.server.model._dispatch(self, "PATCH")


class ScriptedModel:
    """Scripted Messages API server. ``ScriptedModel(scripts).start()`` then use ``base_url``."""

    def __init__(
        self,
        scripts: dict[str, list[dict]] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        cache_min_tokens: int = 1024,
        context_window: int = DEFAULT_CONTEXT_WINDOW,
        rate_limits: RateLimits | None = None,
    ) -> None:
        self._book = ScriptBook(scripts)
        self.limiter = RateLimiter(rate_limits)
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._cache = PromptCache(cache_min_tokens)
        self._answerer = Answerer(self._book, self._cache, self._lock, context_window, self.limiter)
        self._deltas = DeltaLog()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._routes: dict[str, dict[str, Callable[[Any], tuple[int, dict]]]] = {
            "/v1/messages": {"POST": self._handle_messages},
            "/_stats": {"GET": lambda _body: (200, self.stats())},
            "/_scripts": {"POST": self._handle_set_scripts},
            "/_reset": {"POST": self._handle_reset},
        }
        self._reset_counters()

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> ScriptedModel:
        if self._server is not None:
            return self
        self._server = _Server((self._host, self._port), self)
        # A short poll interval keeps stop() (which waits for the next poll) fast in test teardown.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-model", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.close_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("ScriptedModel is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ---- state -----------------------------------------------------------------------------------

    def _reset_counters(self) -> None:
        with self._lock:
            self._counts = {
                "requests": 0,
                "responses": 0,
                "rejected": 0,
                "errors_injected": 0,
                "streams": 0,
                "streams_cut": 0,
                "compactions": 0,
                "summaries": 0,
            }
            self._rejections: list[str] = []
            self._by_script: dict[str, int] = {}
            self._tokens = dict.fromkeys(TOKEN_KINDS, 0)  # of every reply served, as its usage says
            self._request_bytes: list[int] = []
            self._book.forget_errors()
            self._cache.clear()
        self._answerer.faults.clear()
        self._deltas.clear()

    def reset(self) -> None:
        """Zero the counters, forget injected-error counts and the prompt cache, refill the rate limits."""
        self._reset_counters()
        self.limiter.refill()

    def set_rate_limits(self, limits: RateLimits | None) -> None:
        """Enforce ``limits`` from now on (None: no limits), starting with full buckets."""
        self.limiter.configure(limits)

    def stats(self) -> dict:
        with self._lock:
            return {
                **self._counts,
                "rejections": list(self._rejections),
                "by_script": dict(self._by_script),
                "tokens": dict(self._tokens),
                "request_bytes": list(self._request_bytes),
                "rate_limited": self.limiter.refused,
            }

    def delta_times(self) -> list[tuple[float, str]]:
        """(``time.monotonic()``, text) of every text delta streamed since the last reset, oldest first."""
        return self._deltas.items()

    def set_scripts(self, scripts: dict[str, list[dict]]) -> list[str]:
        return self._book.replace(scripts)

    # ---- HTTP plumbing ---------------------------------------------------------------------------

    def _dispatch(self, handler: _Handler, method: str) -> None:
        request_id = random_id("req_")
        try:
            # Read the body even for a request we reject: with keep-alive, unread bytes would be
            # taken for the next request on this connection.
            raw = self._read_raw_body(handler)
            if raw is None:
                # The client died mid-request (a SIGKILLed worker): the real API never sees a request
                # it did not receive whole, so this is neither a request nor a rejection.
                handler.close_connection = True
                return
            path = urllib.parse.urlsplit(handler.path).path.rstrip("/") or "/"
            methods = self._routes.get(path)
            if methods is None:
                raise ApiError(404, "not_found_error", f"Not found: {method} {path}")
            if method not in methods:
                raise ApiError(
                    405,
                    "invalid_request_error",
                    f"Method {method} not allowed for {path}",
                    {"allow": ", ".join(methods)},
                )
            if path == "/v1/messages":
                with self._lock:
                    self._counts["requests"] += 1
                    self._request_bytes.append(len(raw))
                    del self._request_bytes[:-MAX_REQUEST_SIZES_KEPT]
                self._check_auth(handler)
                self._answer(handler, parse_json(raw), betas_of(handler.headers.get("anthropic-beta")), request_id)
                return
            status, payload = methods[method](parse_json(raw))
            self._send(handler, status, payload, request_id, {})
        except InjectedError as injected:
            with self._lock:
                self._counts["errors_injected"] += 1
            self._send(
                handler,
                injected.error.status,
                error_body(injected.error, request_id),
                request_id,
                injected.error.headers,
            )
        except ApiError as err:
            self._record_rejection(err.message)
            self._send(handler, err.status, error_body(err, request_id), request_id, err.headers)

    @staticmethod
    def _read_raw_body(handler: _Handler) -> bytes | None:
        """The request's body; None when the connection ended before all of it came."""
        try:
            length = int(handler.headers.get("content-length") or 0)
        except ValueError:
            raise invalid("Content-Length header is not an integer") from None
        if length <= 0:
            return b""
        try:
            raw = handler.rfile.read(length)
        except ConnectionError:
            return None
        return raw if len(raw) == length else None

    @staticmethod
    def _check_auth(handler: _Handler) -> None:
        # Presence only: the value is never compared, logged or stored.
        bearer = handler.headers.get("authorization", "")
        has_bearer = bearer.lower().startswith("bearer ") and bearer[7:].strip() != ""
        if not (handler.headers.get("x-api-key") or has_bearer):
            raise ApiError(401, "authentication_error", "x-api-key header is required")
        if not handler.headers.get("anthropic-version"):
            raise invalid("anthropic-version: header is required")

    @staticmethod
    def _send(handler: _Handler, status: int, payload: dict, request_id: str, headers: dict[str, str]) -> None:
        data = json.dumps(payload).encode("utf-8")
        try:
            handler.send_response(status)
            handler.send_header("content-type", "application/json")
            handler.send_header("content-length", str(len(data)))
            handler.send_header("request-id", request_id)
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (e.g. its timeout fired during a scripted delay)

    def _record_rejection(self, message: str) -> None:
        with self._lock:
            self._counts["rejected"] += 1
            self._rejections.append(message)
            del self._rejections[:-MAX_REJECTIONS_KEPT]

    # ---- endpoints -------------------------------------------------------------------------------

    def _handle_set_scripts(self, body: Any) -> tuple[int, dict]:
        if not isinstance(body, dict):
            raise invalid("POST /_scripts needs a JSON object mapping script names to lists of steps")
        try:
            names = self.set_scripts(body)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return 200, {"ok": True, "scripts": names}

    def _handle_reset(self, _body: Any) -> tuple[int, dict]:
        self.reset()
        return 200, {"ok": True}

    def _answer(self, handler: _Handler, body: Any, betas: frozenset[str], request_id: str) -> None:
        streaming = isinstance(body, dict) and body.get("stream") is True
        answer: Answer = self._answerer.answer(body, betas, streaming)
        with self._lock:
            self._counts["responses"] += 1
            self._counts["summaries"] += answer.kind == "summary"
            self._counts["compactions"] += answer.compacted or answer.kind == "compaction"
            self._counts["streams"] += streaming
            self._counts["streams_cut"] += streaming and answer.cut is not None
            self._by_script[answer.script] = self._by_script.get(answer.script, 0) + 1
            for kind in TOKEN_KINDS:
                self._tokens[kind] += int(answer.message["usage"].get(kind) or 0)
        if not streaming:
            self._send(handler, 200, answer.message, request_id, answer.headers)
            return
        StreamWriter(handler, request_id, self._deltas.add, answer.headers).send(
            answer.message, answer.stream, answer.cut
        )

    def _handle_messages(self, body: Any) -> tuple[int, dict]:
        raise AssertionError("answered by _answer, which needs the request's headers and connection")
