"""``agentpool dashboard``: a web page for runs, served by this process alone (no build step).

The page is plain HTML, CSS and JavaScript from ``dashboard_static/``; it polls the JSON endpoints
below, which read Redis through ``agentpool.client`` and ``store``::

    GET  /api/config                      {"token_required": bool}
    GET  /api/runs?status=&agent=&limit=  run headers, newest first (``note``: why an active run waits)
    GET  /api/runs/<id>?from=N            header (with resume_needs when stopped; ``waiting``: why it is not
                                          moving, since when), messages[N:], ledger
    GET  /api/runs/<id>/events?after=ID   events after stream id ID
    GET  /api/runs/<id>/live?after=ID     the model call in flight, as it streams: entries after ID, waiting
                                          up to 2 s for one (a long poll; ``busy``: too many wait already, so
                                          this one did not); asking is what makes workers publish
    GET  /api/runs/<id>/timeline          the run's turns (model, tools, waits, takeovers, compactions, tokens,
                                          cost) from its recorded events
    POST /api/runs/<id>/cancel            {}
    POST /api/runs/<id>/approve           {"approved": bool (required), "tool_use_id": str|null, "reason": str|null}
    POST /api/runs/<id>/resume            {"add_turns": int, "add_tokens": int, "add_usd": float}
    POST /api/runs/<id>/message           {"text": str, "message_id": str|null} -> {"ok", "message_id"}
    POST /api/runs/<id>/fork              {"at_turn": int|null, "fork_id": str|null} -> {"ok", "run_id"}

Errors are ``{"error": text}``: 400 bad input (NaN, an unknown status), 401, 403, 404, 408, 409 refused by
the run's state (a resume that cannot help), 415, 503 Redis (or the run's shard: ``unavailable`` says which)
unavailable, or too many connections. docs/operations.md documents it all.
On a sharded pool (``AGENTPOOL_SHARDS``) the list merges every shard's runs, newest first, and a run's
endpoints read the shard that holds it; each run (row and header) then says its ``shard``.

Security. Bound to a loopback address and given no token, anyone on this machine may act, and requests
naming another Host are refused (a DNS-rebinding page cannot reach it). Bound anywhere else, it refuses
to start without a token, and then every /api/ request but /api/config must carry
``Authorization: Bearer <token>``: conversations are the users' data, so reading them is guarded too.
``AGENTPOOL_DASHBOARD_TOKENS`` gives each person a token of their own instead: what they do is recorded
under their name (an approval's ``by``, a cancelled run's error, a log line per action).
Every POST must be JSON (so a cross-site form cannot send one without a CORS preflight, which this
server never grants) from no Origin or its own. Without a token, a request through a proxy (Forwarded,
X-Forwarded-*) is refused: a proxy on this machine would pass the Host check. A connection gets
``AGENTPOOL_DASHBOARD_IDLE_TIMEOUT`` seconds per read or write, and at most
``AGENTPOOL_DASHBOARD_MAX_CONNECTIONS`` are served at once, so idle connections cannot starve the rest.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import click
from redis import Redis
from redis.exceptions import RedisError

from agentpool import client, conversation
from agentpool.checks import InvalidLimit, limit_value
from agentpool.ops.redisconn import pool_client, target_url, warn_if_unreachable
from agentpool.ops.timeline import timeline
from agentpool.runtime.progress import clock, why_waiting
from agentpool.runtime.settings import env_number, redact_url
from agentpool.runtime.shards import Shards, each_answering, located
from agentpool.store import children, events, handback, inbox, ledger, live, runs_index, webhooks
from agentpool.store.errors import AgentPoolError, RedisUnreachable, RunNotFound
from agentpool.store.keys import RunKeys
from agentpool.store.records import STATUSES, load_header, unpack_message
from agentpool.watching import live_item

log = logging.getLogger("agentpool.dashboard")

STATIC = Path(__file__).resolve().parent / "dashboard_static"
PAGES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
TOKEN_ENV = "AGENTPOOL_DASHBOARD_TOKEN"
TOKENS_ENV = "AGENTPOOL_DASHBOARD_TOKENS"  # name=token entries: each person's own, named in what they do
UNNAMED = "person"  # who acts with the one token of TOKEN_ENV, or with none
MAX_BODY = 64 * 1024
SCAN_WHEN_FILTERED = 2000  # newest runs looked at to fill a filtered page
LEDGER_TEXT_CHARS = 2000  # the whole result is in the conversation; the ledger shows its head
RUN_PAGE = re.compile(r"/runs/[A-Za-z0-9_-]{1,100}")
RUN_PATH = re.compile(
    r"^/api/runs/([A-Za-z0-9_-]{1,100})(/events|/live|/timeline|/cancel|/approve|/resume|/message|/fork)?$"
)
LIVE_WAIT_MS = 2000  # a live request waits this long for output before answering empty
# Each waiting long poll holds one of the Redis client's pooled connections for LIVE_WAIT_MS: past this
# many at once (open tabs, a script), a poll answers at once with what there is, so the lists, pages and
# actions always find a connection.
LIVE_POLLS = 16
IDLE_TIMEOUT_ENV = "AGENTPOOL_DASHBOARD_IDLE_TIMEOUT"
MAX_CONNECTIONS_ENV = "AGENTPOOL_DASHBOARD_MAX_CONNECTIONS"
IDLE_TIMEOUT = 30.0  # seconds a client may leave a socket read or write unfinished (request line, headers, body)
MAX_CONNECTIONS = 256  # connections served at once; more are answered 503 and closed
PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "X-Real-IP")
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\n\r\n"
    b'{"error": "the dashboard is serving too many connections; try again shortly"}'
)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- reading runs ------------------------------------------------------------------------------


def _note(waiting: handback.HandBack | None, status: str) -> str:
    """Why an active run is not moving, when a worker handed its turn back (the run page says more)."""
    if waiting is None or status not in ("queued", "running"):
        return ""
    if waiting.reason == "not_replicated":
        return f"waiting for a replica to acknowledge since {clock(waiting.since)} (AGENTPOOL_REPLICA_ACKS)"
    return f"handed back: {waiting.describe()}"


def _row(run: client.Run, now: float, waiting: handback.HandBack | None = None) -> dict[str, Any]:
    return {
        "note": _note(waiting, run.status),
        "id": run.id,
        "agent": run.agent,
        "queue": run.queue,
        "status": run.status,
        "turns": run.turns,
        "tokens": run.total_tokens,
        "usage": run.usage,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
        "error": (run.error or "")[:300],
        "age": max(0.0, now - run.created_at),
        "cost_usd": getattr(run, "cost_usd", None),
    }


def list_rows(r: Redis, *, status: str | None, agent: str | None, limit: int) -> dict[str, Any]:
    """A page of runs, newest first. Filtered, it looks at the newest ``SCAN_WHEN_FILTERED`` runs only:
    the page refreshes itself, and ``agentpool runs --status`` looks through them all."""
    filtered = bool(status or agent)
    now = time.time()
    agents: set[str] = set()

    def wanted(run_status: str, run_agent: str) -> bool:
        agents.add(run_agent)  # the page's agent menu: every agent among the runs looked at
        return (not status or run_status == status) and (not agent or client.agent_matches(agent, run_agent))

    picked: list[client.Run] = []
    scan = SCAN_WHEN_FILTERED if filtered else limit
    pages = runs_index.iter_headers(r, page=min(runs_index.PAGE, scan), scan=scan, where=wanted if filtered else None)
    for run_id, raw in pages:
        try:
            # Not opening sealed fields: a listing needs no key when encryption at rest is on.
            run = client.Run.from_state(load_header(run_id, raw, open_sealed=False))
        except AgentPoolError:
            continue  # an unreadable record is shown by `agentpool show`, not guessed at here
        agents.add(run.agent)  # unfiltered, every run looked at is read whole: no two-field pass first
        if len(picked) < limit:
            picked.append(run)
    with r.pipeline(transaction=False) as pipe:
        for run in picked:
            pipe.hgetall(RunKeys.of(run.id).handback)
        handbacks = pipe.execute()
    rows = [_row(run, now, handback.decode(raw)) for run, raw in zip(picked, handbacks)]
    return {"now": now, "runs": rows, "agents": sorted(agents), "statuses": sorted(STATUSES), "unavailable": []}


def pool_rows(pool: Redis | Shards, *, status: str | None, agent: str | None, limit: int) -> dict[str, Any]:
    """``list_rows`` of one Redis, or of every shard merged newest first (each row saying its shard); a
    shard that does not answer is listed in ``unavailable`` and the others' runs are shown."""
    if not isinstance(pool, Shards):
        return list_rows(pool, status=status, agent=agent, limit=limit)
    pages, unavailable = each_answering(pool, lambda r: list_rows(r, status=status, agent=agent, limit=limit))
    rows = [{**row, "shard": shard} for shard, page in pages for row in page["runs"]]
    rows.sort(key=lambda row: (row["created_at"], row["id"]), reverse=True)
    agents = sorted({name for _shard, page in pages for name in page["agents"]})
    return {
        "now": time.time(),
        "runs": rows[:limit],
        "agents": agents,
        "statuses": sorted(STATUSES),
        "unavailable": unavailable,
    }


def _slim(block: Any) -> Any:
    """Base64 payloads (images, documents) are no use on the page and can be megabytes."""
    if isinstance(block, dict):
        source = block.get("source")
        if isinstance(source, dict) and isinstance(source.get("data"), str):
            block = {**block, "source": {**source, "data": f"({len(source['data'])} characters of base64)"}}
        return {k: _slim(v) if k == "content" else v for k, v in block.items()}
    if isinstance(block, list):
        return [_slim(b) for b in block]
    return block


def ledger_rows(r: Redis, keys: RunKeys) -> dict[str, dict[str, Any]]:
    """The ledger in the order the calls started, without the lease owner (nothing a reader needs)."""

    def started(entry: dict[str, Any]) -> float:
        return float((entry.get("intent") or {}).get("started_at") or (entry.get("outcome") or {}).get("at") or 0)

    rows = {}
    for tool_use_id, entry in sorted(ledger.read_all(r, keys).items(), key=lambda kv: started(kv[1])):
        intent, outcome = entry.get("intent") or {}, entry.get("outcome")
        rows[tool_use_id] = {
            "name": intent.get("name") or (outcome or {}).get("name"),
            "effect": intent.get("effect"),
            "attempt": intent.get("attempt", 0),
            "started_at": intent.get("started_at"),
            "outcome": None
            if outcome is None
            else {
                "how": outcome.get("how"),
                "is_error": bool(outcome.get("is_error")),
                "at": outcome.get("at"),
                # After save point B the ledger keeps only a note; the result is in the conversation.
                "content": None if "stored_in" in outcome else str(outcome.get("content", ""))[:LEDGER_TEXT_CHARS],
                "chars": outcome.get("chars"),
            },
        }
    return rows


def run_detail(r: Redis, run_id: str, start: int) -> dict[str, Any]:
    """The header, the messages from index ``start`` on (the page keeps the earlier ones), the ledger."""
    keys = RunKeys.of(run_id)
    with r.pipeline(transaction=True) as pipe:  # header and messages as of one instant
        pipe.hgetall(keys.run)
        pipe.lrange(keys.messages, start, -1)
        raw, blobs = pipe.execute()
    if not raw:
        raise RunNotFound(run_id)
    state = load_header(run_id, raw)
    run = client.Run.from_state(state)
    if run.status == "waiting_approval":
        # Which calls still await a decision is the API's to say (it reads the approval records).
        run.pending = client.get_run(run_id, connection=r).pending
    messages = [_slim(unpack_message(blob, start + i)) for i, blob in enumerate(blobs)]
    # The header's window hint (exact for a summary); the page moves it on to a later compaction block.
    run.window_start = state.window_hint
    found = why_waiting(r, run_id, run.status)
    run.waiting = found.to_dict() if found else None
    run.inbox = [{"id": m["id"], "content": _slim(m["content"])} for m in inbox.waiting(r, keys)]
    run.webhooks = webhooks.deliveries(r, keys)
    header = run.to_dict()
    header.pop("messages")
    now = time.time()
    header.update(tokens=run.total_tokens, age=max(0.0, now - run.created_at))
    header["children"] = children.children(r, keys)
    if header["children"]:  # each child run's status and cost, recursively (a child waiting for approval shows here)
        header["tree"] = client.run_tree(run_id, connection=r)["children"]
    if run.status == "stopped":  # the least a resume must add (the page prefills at least that)
        header["resume_needs"] = client.resume_needs(r, run_id)
    return {
        "now": now,
        "run": header,
        "messages": messages,
        "messages_from": start,
        "message_count": start + len(messages),
        "ledger": ledger_rows(r, keys),
    }


def live_output(r: Redis, run_id: str, after: str, *, wait: bool = True) -> dict[str, Any]:
    """The run's live output after stream id ``after``, waiting a little for some (unless ``wait`` is
    false: too many polls wait already, and ``busy`` tells the page to pause); marks the run watched."""
    keys = RunKeys.of(run_id)
    if not r.exists(keys.run):
        raise RunNotFound(run_id)
    live.mark_watching(r, keys)
    replies = r.xread({keys.live: after}, count=500, block=LIVE_WAIT_MS if wait else None) or []
    entries = [live_item(i, f) for _key, rows in replies for i, f in live.decode_entries(rows)]  # type: ignore[union-attr]
    return {"entries": entries, "last": entries[-1]["id"] if entries else after, "busy": not wait}


# -- actions -----------------------------------------------------------------------------------


def _amount(body: dict[str, Any], name: str, *, whole: bool) -> Any:
    """An amount ``resume`` adds: absent or null is 0; NaN, Infinity (JSON allows both) and bools are a 400."""
    value = body.get(name)
    try:
        return limit_value(name, 0 if value is None else value, whole=whole, zero_ok=True)
    except InvalidLimit as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None


def act(r: Redis | Shards, run_id: str, action: str, body: dict[str, Any], by: str = UNNAMED) -> dict[str, Any]:
    """A run's action through the API, given the whole pool: a fork on a sharded pool gets its shard's
    id ending, and a ``fork_id`` is refused when it is taken on any shard. ``by``: whose token asked
    (an approval's decision names it; the other actions' events name it when the token has a name, and
    a cancelled run's error says it)."""
    named = None if by == UNNAMED else by
    if action == "cancel":
        reason = "cancelled from the dashboard" + (f" by {by}" if named else "")
        before = client.cancel_run(run_id, connection=r, reason=reason, by=named)
        return {"ok": True, "before": before}
    if action == "approve":
        # `approved` has no default: a body that does not say is refused, never taken for a yes.
        tool_use_id, reason, approved = body.get("tool_use_id"), body.get("reason"), body.get("approved")
        if (
            not isinstance(approved, bool)
            or not isinstance(tool_use_id, (str, type(None)))
            or not isinstance(reason, (str, type(None)))
        ):
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                "approve takes approved (bool, required), tool_use_id (string) and reason (string)",
            )
        result = client.approve(run_id, tool_use_id, approved=approved, reason=reason or None, by=by, connection=r)
        return {"ok": True, "result": result}
    if action == "resume":
        result = client.resume(
            run_id,
            add_turns=_amount(body, "add_turns", whole=True),
            add_tokens=_amount(body, "add_tokens", whole=True),
            add_usd=_amount(body, "add_usd", whole=False),
            by=named,
            connection=r,
        )
        return {"ok": True, "result": result}
    if action == "message":
        text, message_id = body.get("text"), body.get("message_id")
        if not isinstance(text, str) or not isinstance(message_id, (str, type(None))):
            raise HttpError(HTTPStatus.BAD_REQUEST, "message takes text (string) and message_id (string or null)")
        try:
            sent = conversation.send_message(run_id, text, message_id=message_id, by=named, connection=r)
        except ValueError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        return {"ok": True, "message_id": sent}
    if action == "fork":
        at_turn, fork_id = body.get("at_turn"), body.get("fork_id")
        if (at_turn is not None and (not isinstance(at_turn, int) or isinstance(at_turn, bool))) or not isinstance(
            fork_id, (str, type(None))
        ):
            raise HttpError(HTTPStatus.BAD_REQUEST, "fork takes at_turn (integer or null) and fork_id (string or null)")
        try:
            new_id = conversation.fork_run(run_id, at_turn=at_turn, fork_id=fork_id, by=named, connection=r)
        except ValueError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        return {"ok": True, "run_id": new_id}
    raise HttpError(HTTPStatus.NOT_FOUND, f"no action {action!r}")


# -- HTTP --------------------------------------------------------------------------------------


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a burst of page loads waits in the kernel's queue, not refused by it

    def __init__(
        self,
        address: tuple[str, int],
        r: Redis | Shards,
        tokens: dict[str, str],
        *,
        idle_timeout: float = IDLE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.r = r
        self.tokens = [(name, token.encode()) for name, token in tokens.items()]  # empty: no token asked
        self.loopback = is_loopback(address[0])
        self.idle_timeout = idle_timeout
        # A thread per connection, and a connection may be slow on purpose: both are bounded.
        self.slots = threading.BoundedSemaphore(max_connections)
        self.live_polls = threading.BoundedSemaphore(LIVE_POLLS)
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            # Full: answer at once rather than queue behind connections that may never finish. The
            # send is a few bytes into a new socket's empty buffer; the timeout only guards the odd case.
            try:
                request.settimeout(1)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A browser that closed its connection mid-request is no error worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    server_version = "agentpool-dashboard"
    sys_version = ""
    shard: str | None = None  # "shard N", on a sharded pool the shard of the run asked about: a 503 names it
    actor = UNNAMED  # whose token this request carries: the name its actions are recorded under

    def setup(self) -> None:
        # Every read and write of the connection (request line, headers, body, the answer) gets this long:
        # a client that stops sending half-way loses its connection instead of holding a thread forever.
        self.timeout = self.server.idle_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # the base class's parameter name
        # Requests are polled every second; the path may carry ?token= on a first visit.
        log.debug("%s %s", self.address_string(), self.command)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        self.shard, self.actor = None, UNNAMED  # this request's (a kept-alive connection serves several)
        try:
            self._check_host()
            url = urlsplit(self.path)
            if not url.path.startswith("/api/"):
                return self._static(url.path)
            if url.path != "/api/config":
                self.actor = self._check_token()
            if self.command == "POST":
                self._check_post()
            self._json(HTTPStatus.OK, self._api(url.path, parse_qs(url.query)))
        except HttpError as exc:
            self._json(exc.status, {"error": str(exc)})
        except RunNotFound as exc:
            self._json(HTTPStatus.NOT_FOUND, {"error": str(exc)})
        except RedisError as exc:
            # Before AgentPoolError: the API's RedisUnreachable is both, and an unreachable Redis is no
            # refusal by the run's state (409) but a 503 the page shows and retries.
            log.warning("dashboard: Redis failed: %s", exc)
            where = self.shard or "Redis"
            self._json(
                HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"{where} is unavailable; retrying", "unavailable": where}
            )
        except (AgentPoolError, ValueError) as exc:
            self._json(HTTPStatus.CONFLICT, {"error": str(exc)})
        except Exception:
            log.exception("dashboard: %s %s failed", self.command, urlsplit(self.path).path)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the dashboard's log"})

    # -- guards --

    def _check_host(self) -> None:
        if self.server.tokens or not self.server.loopback:
            return
        # A reverse proxy on this machine connects from loopback and may pass a loopback Host: without a
        # token, everyone the proxy serves could act. Its forwarding headers give it away.
        forwarded = [name for name in PROXY_HEADERS if name in self.headers]
        if forwarded:
            raise HttpError(
                HTTPStatus.FORBIDDEN,
                f"this request came through a proxy ({forwarded[0]}) and the dashboard has no token: "
                f"set {TOKEN_ENV} (or --token) to serve it through a proxy",
            )
        host = (self.headers.get("Host") or "").strip()
        name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
        if not is_loopback(name):
            raise HttpError(HTTPStatus.FORBIDDEN, "this dashboard answers only to localhost")

    def _check_token(self) -> str:
        """The name of the token the request carries (``UNNAMED`` when none is asked for)."""
        if not self.server.tokens:
            return UNNAMED
        given = self.headers.get("Authorization", "")
        if given.startswith("Bearer "):
            sent = given[7:].encode()
            # Every token is compared, whichever matches: the time taken does not tell which one came close.
            matched = [name for name, token in self.server.tokens if hmac.compare_digest(sent, token)]
            if matched:
                return matched[0]
        raise HttpError(HTTPStatus.UNAUTHORIZED, "a valid dashboard token is required")

    def _check_post(self) -> None:
        if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
            raise HttpError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "actions take a JSON body")
        origin = self.headers.get("Origin")
        if origin and urlsplit(origin).netloc != self.headers.get("Host"):
            raise HttpError(HTTPStatus.FORBIDDEN, "cross-origin requests are refused")

    def _body(self) -> dict[str, Any]:
        raw = (self.headers.get("Content-Length") or "0").strip()
        if not raw.isdigit():  # "-1" would make rfile.read() read until the client stops, past MAX_BODY
            raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length must be a whole number of bytes")
        length = int(raw)
        if length > MAX_BODY:
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except TimeoutError:
            raise HttpError(HTTPStatus.REQUEST_TIMEOUT, "the request body did not arrive in time") from None
        except ValueError:
            raise HttpError(HTTPStatus.BAD_REQUEST, "body is not JSON") from None
        if not isinstance(body, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return body

    # -- routes --

    def _api(self, path: str, query: dict[str, list[str]]) -> dict[str, Any]:
        pool = self.server.r

        def arg(name: str) -> str:
            return (query.get(name) or [""])[0]

        def number(name: str, default: int) -> int:
            try:
                return int(arg(name) or default)
            except ValueError:
                raise HttpError(HTTPStatus.BAD_REQUEST, f"{name} must be an integer") from None

        if path == "/api/config" and self.command == "GET":
            return {"token_required": bool(self.server.tokens)}
        if path == "/api/runs" and self.command == "GET":
            limit = min(max(number("limit", 100), 1), 500)
            if arg("status") and arg("status") not in STATUSES:
                raise HttpError(
                    HTTPStatus.BAD_REQUEST, f"unknown status {arg('status')!r}; valid: {', '.join(sorted(STATUSES))}"
                )
            return pool_rows(pool, status=arg("status") or None, agent=arg("agent") or None, limit=limit)
        match = RUN_PATH.match(path)
        if not match:
            raise HttpError(HTTPStatus.NOT_FOUND, "no such endpoint")
        run_id, sub = match.group(1), (match.group(2) or "").lstrip("/")
        try:
            r, shard = located(pool, run_id)  # one Redis, or the shard that holds the run
        except RedisUnreachable as exc:
            # No shard that answers has the run: the silent one may (Shards.find says which).
            self.shard = f"shard {exc.shard}" if exc.shard is not None else None
            raise
        if shard is not None:
            self.shard = f"shard {shard}"
        if self.command == "GET" and not sub:
            detail = run_detail(r, run_id, max(number("from", 0), 0))
            if shard is not None:
                detail["run"]["shard"] = shard
            return detail
        if self.command == "GET" and sub == "events":
            after = arg("after") or "0-0"
            if not re.fullmatch(r"\d+-\d+", after):
                raise HttpError(HTTPStatus.BAD_REQUEST, "after must be a stream id like 1700000000000-0")
            rows = events.read(r, run_id, after=after)
            return {"events": [{"id": i, **fields} for i, fields in rows]}
        if self.command == "GET" and sub in ("live", "timeline"):
            if sub == "timeline":
                # The newest events, oldest first: the stream is trimmed only about at MAX_EVENTS, so
                # reading from its start could leave a long run's latest turns out.
                return timeline(events.latest(r, run_id, count=events.MAX_EVENTS)[::-1])
            after = arg("after") or "0-0"
            if not re.fullmatch(r"\d+-\d+", after):
                raise HttpError(HTTPStatus.BAD_REQUEST, "after must be a stream id like 1700000000000-0")
            waiting = self.server.live_polls.acquire(blocking=False)
            try:
                return live_output(r, run_id, after, wait=waiting)
            finally:
                if waiting:
                    self.server.live_polls.release()
        if self.command == "POST" and sub in ("cancel", "approve", "resume", "message", "fork"):
            done = act(pool, run_id, sub, self._body(), by=self.actor)
            # The audit trail of who did what from the page: names and ids only, never a message's text.
            log.info("dashboard: %s on run %s by %s from %s", sub, run_id, self.actor, self.client_address[0])
            return done
        raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not allowed here")

    def _static(self, path: str) -> None:
        if self.command != "GET":
            raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, "pages are read with GET")
        if path == "/" or RUN_PAGE.fullmatch(path):
            name = "index.html"
        elif path.startswith("/static/") and path.removeprefix("/static/") in PAGES:
            name = path.removeprefix("/static/")
        else:
            raise HttpError(HTTPStatus.NOT_FOUND, "not found")
        self._send(HTTPStatus.OK, (STATIC / name).read_bytes(), PAGES[name])

    def _json(self, status: HTTPStatus, doc: dict[str, Any]) -> None:
        self._send(status, json.dumps(doc, ensure_ascii=False, default=str).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("X-Frame-Options", "DENY")
        self.end_headers()
        self.wfile.write(body)


def named_tokens(text: str) -> dict[str, str]:
    """``AGENTPOOL_DASHBOARD_TOKENS``: ``name=token`` entries separated by commas or whitespace, as
    ``{name: token}``. A ``ValueError`` names the entry at fault, never a token."""
    from agentpool.checks import check_actor

    tokens: dict[str, str] = {}
    for n, entry in enumerate(filter(None, re.split(r"[,\s]+", text)), 1):
        name, sep, token = entry.partition("=")
        if not sep:
            raise ValueError(f"{TOKENS_ENV}: entry {n} is not name=token")
        try:
            check_actor(name)
        except ValueError as exc:
            raise ValueError(f"{TOKENS_ENV}: entry {n}: {exc}") from None
        if name == UNNAMED or name in tokens:
            taken = "given twice" if name in tokens else "what actions with no name are recorded under"
            raise ValueError(f"{TOKENS_ENV}: the name {name!r} is {taken}")
        if len(token) < 16 or not token.isascii():
            raise ValueError(f"{TOKENS_ENV}: {name}'s token must be at least 16 ASCII characters (agentpool genkey)")
        if token in tokens.values():
            raise ValueError(f"{TOKENS_ENV}: {name}'s token is another name's too: whose actions would it be?")
        tokens[name] = token
    if not tokens:
        raise ValueError(f"{TOKENS_ENV} is set but names no token")
    return tokens


def make_server(
    r: Redis | Shards,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    tokens: dict[str, str] | None = None,
) -> DashboardServer:
    """The server, bound and ready for ``serve_forever()``, reading one Redis or a sharded pool's
    ``Shards``. ``token``: the one every request carries; ``tokens``: one per person (``{name: token}``),
    whose name the actions taken with it are recorded under. Refuses a non-loopback address without a
    token."""
    if token and tokens:
        raise ValueError(f"give {TOKEN_ENV} (--token) or {TOKENS_ENV} (--tokens), not both")
    if not (token or tokens) and not is_loopback(host):
        raise ValueError(
            f"the dashboard would listen on {host}, beyond this machine, with no token: set {TOKEN_ENV} "
            f"or pass --token (then every request must carry it), or give each person one in {TOKENS_ENV}, "
            "or bind 127.0.0.1"
        )
    if token and not token.isascii():
        # HTTP headers arrive decoded as Latin-1 and browsers send non-ASCII ones unlike curl: such a
        # token could never be matched reliably.
        raise ValueError(f"the dashboard token ({TOKEN_ENV} or --token) must be ASCII characters only")
    return DashboardServer(
        (host, port),
        r,
        tokens or ({UNNAMED: token} if token else {}),
        idle_timeout=env_number(IDLE_TIMEOUT_ENV, IDLE_TIMEOUT),
        max_connections=max(1, int(env_number(MAX_CONNECTIONS_ENV, MAX_CONNECTIONS))),
    )


def _guard(server: DashboardServer) -> str:
    names = [name for name, _ in server.tokens]
    if names == [UNNAMED]:
        return "token required"
    return f"tokens of {', '.join(names)}" if names else "no token: localhost only"


@click.command()
@click.option("--url", "-u", envvar="REDIS_URL", default=None, help="Redis URL (env REDIS_URL).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", "-p", type=int, default=8000, show_default=True)
@click.option(
    "--token",
    envvar=TOKEN_ENV,
    default=None,
    show_envvar=True,
    help="Required from every API request; mandatory when --host is not a loopback address. "
    "Prefer the environment variable: a flag is visible in ps.",
)
@click.option(
    "--tokens",
    envvar=TOKENS_ENV,
    default=None,
    show_envvar=True,
    help="Instead of --token, one token per person: 'alice=TOKEN,bob=TOKEN' (16 characters at least; "
    "agentpool genkey prints one). What each does is recorded under their name. Prefer the environment "
    "variable: a flag is visible in ps.",
)
def dashboard(url: str | None, host: str, port: int, token: str | None, tokens: str | None) -> None:
    """Serve a web page for watching and steering runs."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    r = pool_client(url, health_check_interval=30)
    source = redact_url(target_url(url)) if not isinstance(r, Shards) else ", ".join(r.names)
    try:
        server = make_server(r, host, port, token, named_tokens(tokens) if tokens is not None else None)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    shown = f"[{host}]" if ":" in host else host
    click.echo(
        f"agentpool dashboard on http://{shown}:{server.server_address[1]}/ ({_guard(server)}) from {source}",
        err=True,
    )
    warn_if_unreachable(r, "the page shows 'Redis unavailable' until it answers")
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
