"""A worker process's connections to MCP servers: one session per server, reused across turns.

The ``mcp`` SDK is async; turns are not. So a process that uses MCP servers runs one event loop in a
thread of its own (the hub), which holds every session, and turn threads call into it and wait.

A forking worker's work horses are forked for one turn each, and threads do not survive a fork: the
hub lives in the worker process (the agent is preloaded there before each fork, which connects and
lists the tools), and a horse reaches it over a Unix socket the hub serves from a private directory.
So a forking worker starts one server process per stdio server, not one per horse; a horse's call
costs one local socket round trip more. When a horse dies mid-call, the worker ends that call before
it hands the turn over (``end_calls_of``): a stdio server with a call of the dead horse in flight is
stopped (its process, like a tool's subprocess, must not take effect after the takeover decided the
call did not), an HTTP request is cancelled (as the horse's own request would have died with it). A
request the dead horse wrote that the hub had not read yet is refused when it is read: the worker
numbers its horses (``next_horse``), each request carries its horse's number, and the hub serves no
call of a horse it was told has ended. (Numbers, not process ids: a later horse may get a dead one's.)

A stdio server is started through ``agentpool.runtime.mcp_launch``, so that (on Linux) it dies with the
worker process that started it: the SDK puts it in a session of its own, where ending a dead worker's
process group before its turns are handed over does not reach it.

A call fails in one of two ways, and the model (and the ledger) is told which. The server answered it
with an error (``isError``, or a JSON-RPC error reply such as invalid params): the call failed, and the
session is kept. The call was lost on the way (the server died or dropped the connection mid-call, or
gave no answer within the tool's timeout): whether it took effect is unknown, and only that session is
dropped; the next call or listing connects again. (An HTTP call that timed out beside other calls in
flight on its session leaves the session to them.) A server that cannot be reached fails the call too.

A call is made again only where it provably never reached the server: a stdio server whose process
had exited before the call was written (the launcher records its process id) gets a new process first;
an HTTP server that answered the call's own request with a 404 for its session (it restarted, or
expired the session: the spec's "start a new session") gets it again once, on a new session. A server
whose connect attempt hung is left untried for a while that doubles (1 s up to a minute).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from agentpool.agent import Agent
from agentpool.mcp_tools import McpTool, ServerConfig, build_tool
from agentpool.runtime import mcp_launch
from agentpool.runtime.settings import Settings

if TYPE_CHECKING:
    from mcp import MCPError

log = logging.getLogger("agentpool.mcp")
# Seconds to start (or reach) a server, initialize the session and list its tools: AGENTPOOL_MCP_CONNECT_TIMEOUT,
# read once where the hub is imported (the worker process).
CONNECT_TIMEOUT = Settings.from_env().mcp_connect_timeout
# A server whose connect attempt hung (no answer for SLOW_FAILURE seconds or more) is not tried again
# for a while, so that each turn (and a forking worker's preload before each fork) does not wait on it
# in turn: RETRY_AFTER after the first such attempt, doubling with each one in a row, up to RETRY_MAX.
# One that refused at once (its process is down, nothing listens) costs nothing to try again, and is:
# it may be back already.
RETRY_AFTER = 1.0
RETRY_MAX = 60.0
SLOW_FAILURE = 0.5
# Seconds a session may take to close before it is abandoned: an HTTP server is told the session ended
# (it may not answer), a stdio server is stopped (the SDK's own bounded sequence: stdin closed, 2 s,
# SIGTERM, 2 s, SIGKILL), which must finish: a server with a dead horse's call in flight must not live on.
CLOSE_WAIT = 10.0
MAX_LINE = 64 * 1024 * 1024  # one request or reply between a work horse and its worker's hub
MCP_SESSION_HEADER = "mcp-session-id"
ATTEMPT_META = "agentpool/attempt"  # in a call's _meta over HTTP: which request a 404 refused


class McpUnavailable(Exception):
    """The server could not be reached, or the call was lost on the way (no answer within the timeout, the
    connection closed mid-call): the call may or may not have taken effect."""


class McpToolFailed(Exception):
    """The server answered that the call failed (``isError``, or a JSON-RPC error reply); the message is its text."""


# The stand-ins the SDK's HTTP transport makes of an HTTP status without a JSON-RPC error in its body
# (mcp 2.3, client/streamable_http.py), known by their message: no reply of the server's to the call.
_HTTP_STAND_INS = ("Server returned an error response", "Session terminated", "Unexpected content type")


def _lost_on_the_way(exc: MCPError) -> bool:
    """An MCPError the SDK made up itself because no reply of the server's arrived or could be read (the
    connection closed: a stdio server died, an HTTP response stream ended; its own request timeout; a
    reply it could not parse): whether the call took effect is unknown. A server that sends one of these
    codes itself is taken the safe way: unknown, never "failed"."""
    from mcp.types import CONNECTION_CLOSED, PARSE_ERROR, REQUEST_TIMEOUT

    return exc.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT, PARSE_ERROR) or exc.message.startswith(_HTTP_STAND_INS)


def _result_text(result: Any) -> dict[str, Any]:
    """A CallToolResult as the text the model gets: text blocks as they are, other blocks as JSON, the
    structured content when there is no text."""
    parts = []
    for block in result.content:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:
            parts.append(json.dumps(block.model_dump(mode="json", by_alias=True, exclude_none=True)))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return {"text": "\n".join(parts), "is_error": bool(result.is_error)}


def _listing(tools: list[Any]) -> list[dict[str, Any]]:
    return [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tools]


class _Connection:
    """One server's session, held open by a task of the hub's loop (the SDK's contexts must be entered
    and left in one task)."""

    def __init__(self, config: ServerConfig, workdir: str) -> None:
        self.config = config
        self._workdir = workdir  # the hub's private directory
        self._pid_file = ""  # where the launcher wrote the stdio server's process id
        self.session: Any = None
        self.tools: list[dict[str, Any]] | None = None
        self._holder: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._lock = asyncio.Lock()
        self._retry_at = 0.0  # no connect attempt before then: the last ones hung
        self._hung = 0  # connect attempts in a row that hung
        self._failure = ""
        self._refused: set[str] = set()  # attempts of calls an HTTP server refused: it knew no such session
        self._in_flight = 0  # calls sent and not answered yet

    def _transport(self) -> Any:
        from mcp import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        c = self.config
        if c.type == "stdio":
            # Started by the hub's event loop thread (the SDK spawns from the loop), which lives as long
            # as the hub: PR_SET_PDEATHSIG fires when the thread that forked exits, so the server dies
            # with the worker process (or at Hub.close, after the sessions are closed).
            with contextlib.suppress(OSError):
                os.unlink(self._pid_file)  # the previous server's
            self._pid_file = os.path.join(self._workdir, f"stdio-{uuid.uuid4().hex}.pid")
            command, args = mcp_launch.command_line(c.command, list(c.args), self._pid_file)
            params = StdioServerParameters(command=command, args=args, env=dict(c.env) or None)
            return stdio_client(params), None
        client = create_mcp_http_client(headers=dict(c.headers) or None)
        client.event_hooks = {**client.event_hooks, "response": [*client.event_hooks["response"], self._note_refusal]}
        return streamable_http_client(c.url, http_client=client), client

    async def _note_refusal(self, response: Any) -> None:
        """An HTTP server answers 404 to a request naming a session it does not know (it restarted, or
        expired the session): the spec's "start a new session", and proof that it did not process the
        request. A call's request carries its attempt id (``_meta``), so the call can tell that its own
        request was the one refused, not another one on the same session."""
        request = response.request
        if response.status_code != 404 or request.method != "POST" or MCP_SESSION_HEADER not in request.headers:
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            self._refused.add(json.loads(request.content)["params"]["_meta"][ATTEMPT_META])

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        from mcp import ClientSession

        assert self._stop is not None
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport, http = self._transport()
                if http is not None:
                    await stack.enter_async_context(http)
                read, write = await stack.enter_async_context(transport)
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                tools, cursor = [], None
                while True:  # every page of tools/list
                    from mcp.types import PaginatedRequestParams

                    page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self.session, self.tools = session, _listing(tools)
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - whatever ended the session is the connection's failure
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else McpUnavailable(repr(exc)))
        finally:
            self.session = None

    async def ensure(self) -> Any:
        async with self._lock:
            if self.session is not None and self._holder is not None and not self._holder.done():
                if not self._stdio_server_exited():
                    return self.session
                # Nothing was sent to it since it exited: the call about to be made goes to a new one.
                await self.reset("its process exited while idle", self.session)
            if time.monotonic() < self._retry_at:
                raise McpUnavailable(self._failure)
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            attempt = time.monotonic()
            self._stop = asyncio.Event()
            self._holder = asyncio.ensure_future(self._hold(ready))
            try:
                await asyncio.wait_for(asyncio.shield(ready), CONNECT_TIMEOUT)
            except BaseException as exc:  # noqa: BLE001 - a cancelled connect fails the same way
                ready.cancel()  # nobody waits for it any more: the holder must not set an exception nobody reads
                await self._close_holder(connected=False)
                self._failure = f"MCP server {self.config.name} is unavailable: {_describe(exc)}"
                self._back_off(hung=time.monotonic() - attempt >= SLOW_FAILURE)
                raise McpUnavailable(self._failure) from None
            self._hung, self._retry_at = 0, 0.0
            log.info("MCP server %s connected: %d tools", self.config.name, len(self.tools or []))
            return self.session

    def _stdio_server_exited(self) -> bool:
        """Whether the stdio server's process is known to have exited (its id as the launcher wrote it).
        False where that is not known: no launcher (not Linux), or an HTTP server."""
        pid = _read_pid(self._pid_file)
        return pid is not None and not _running(pid)

    def _back_off(self, hung: bool) -> None:
        """After a failed connect attempt: one that hung keeps the server untried for a while, longer
        with each such attempt in a row, so a server that accepts and never answers costs a turn now and
        then, not every turn (each attempt waits CONNECT_TIMEOUT)."""
        if not hung:
            log.warning("%s", self._failure)
            return
        self._hung += 1
        wait = min(RETRY_MAX, RETRY_AFTER * 2 ** (self._hung - 1))
        self._retry_at = time.monotonic() + wait
        log.warning("%s; not tried again for %g s", self._failure, wait)

    async def _close_holder(self, connected: bool = True) -> None:
        """End the holder's session: politely (a session is closed: an HTTP server is told it ended, a
        stdio server is stopped) for at most CLOSE_WAIT seconds, then cancelled. A connect attempt that
        failed is cancelled at once: it is stuck in a step that does not watch the stop event."""
        if self._stop is not None:
            self._stop.set()
        holder = self._holder
        if holder is not None and not holder.done():
            if not connected:
                holder.cancel()
            await asyncio.wait([holder], timeout=CLOSE_WAIT)
            holder.cancel()  # a transport that will not close is abandoned (a no-op once it has ended)
        self.session = None

    async def reset(self, why: str, session: Any = None) -> None:
        """Drop the session (only ``session``, if given: one that replaced it serves other calls now)."""
        if session is not None and session is not self.session:
            return
        log.warning("MCP server %s: %s; it is connected again on its next use", self.config.name, why)
        await self._close_holder()

    async def list_tools(self) -> list[dict[str, Any]]:
        await self.ensure()
        return list(self.tools or [])

    async def call(self, tool: str, arguments: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One call, within ``timeout`` from now, a connect included; made again once, on a new session,
        if the server refused it for an unknown session (it restarted while idle): that request provably
        did nothing, so even an unsafe tool may be."""
        deadline = time.monotonic() + timeout
        try:
            return await self._call_once(tool, arguments, timeout, deadline)
        except _SessionUnknown as exc:
            await self.reset(f"it knew no session of ours ({exc}): it restarted or expired it", exc.session)
        try:
            return await self._call_once(tool, arguments, timeout, deadline)
        except _SessionUnknown:
            raise McpUnavailable(
                f"MCP server {self.config.name} refused {tool} twice for an unknown session; it did not run"
            ) from None

    async def _call_once(self, tool: str, arguments: dict[str, Any], timeout: float, deadline: float) -> dict[str, Any]:
        from mcp import MCPError

        session = await self.ensure()
        # The ledger takes the call to be over by its start plus its timeout (``running_until``: a
        # takeover may repeat an idempotent call, or ask a verify hook, after that): a call is never sent
        # later, however long a connect took, nor left running past it.
        left = deadline - time.monotonic()
        if left <= 0:
            raise McpUnavailable(
                f"MCP server {self.config.name}: {tool} was not made: connecting took its whole {timeout:g} s timeout"
            )
        attempt = uuid.uuid4().hex
        meta = {ATTEMPT_META: attempt} if self.config.type == "http" else None
        self._in_flight += 1
        try:
            result = await asyncio.wait_for(session.call_tool(tool, arguments, meta=meta), left)
        except MCPError as exc:
            if attempt in self._refused:
                raise _SessionUnknown(session, exc) from None
            if _lost_on_the_way(exc):
                raise await self._lost(session, tool, f"lost the connection during {tool} ({exc})") from None
            # The server's own error reply: it refused or failed the call, and its session is sound.
            return {"text": f"MCP server {self.config.name} answered {tool} with an error: {exc}", "is_error": True}
        except TimeoutError:
            what = f"gave no answer to {tool} within {timeout:g} s"
            if self.config.type == "http" and self._in_flight > 1:
                # A slow call, while other calls on the session are still in flight: the session is not
                # dropped under them (an HTTP request is cancelled alone; a stdio server is stopped, so
                # that its call does not land later). If the session is broken, they time out too.
                log.warning(
                    "MCP server %s %s; its session is kept for the calls still in flight", self.config.name, what
                )
                raise McpUnavailable(
                    f"MCP server {self.config.name} {what}; whether {tool} took effect is unknown"
                ) from None
            raise await self._lost(session, tool, what) from None
        except asyncio.CancelledError:
            await self.reset(f"a call of {tool} was cancelled", session)
            raise
        except Exception as exc:  # noqa: BLE001 - a transport that broke mid-call
            raise await self._lost(session, tool, f"failed during {tool} ({_describe(exc)})") from None
        finally:
            self._in_flight -= 1
            self._refused.discard(attempt)
        return _result_text(result)

    async def _lost(self, session: Any, tool: str, what: str) -> McpUnavailable:
        """A call lost on the way (as a tool timeout is): its session dropped, its outcome unknown."""
        await self.reset(what, session)
        return McpUnavailable(f"MCP server {self.config.name} {what}; whether {tool} took effect is unknown")


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _running(pid: int) -> bool:
    """Whether the process runs: a zombie has exited (the hub's loop has not reaped it yet); a process
    id taken again by another process reads as running, which only keeps the old answer: not known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


class _SessionUnknown(Exception):
    """An HTTP server refused a call's own request with a 404 for its session: the call did not run."""

    def __init__(self, session: Any, exc: Exception) -> None:
        super().__init__(str(exc))
        self.session = session


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # anyio's task groups wrap the cause
        exc = exc.exceptions[0]
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT:g} s"
    return f"{type(exc).__name__}: {exc}"[:500]


class Hub:
    """The event loop thread, the sessions, and the socket the work horses of a forking worker use."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._connections: dict[str, _Connection] = {}
        self._by_horse: dict[int, set[tuple[asyncio.Task[Any], str]]] = {}
        # Every horse numbered this or lower has ended: a call it asked for is not made. Read and written
        # in the loop's thread only, so that a request is either refused or registered before its horse's
        # calls are ended, never neither.
        self._ended_through = 0
        self._dir = tempfile.mkdtemp(prefix="agentpool-mcp-")  # 0700: only this user reaches the socket
        atexit.register(self._remove_dir)  # its stdio servers die with the process (mcp_launch); not the directory
        self.socket_path = os.path.join(self._dir, "hub.sock")
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="agentpool-mcp", daemon=True)
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(
            asyncio.start_unix_server(self._serve, self.socket_path, limit=MAX_LINE)
        )
        started.set()
        self.loop.run_forever()
        self.loop.close()

    def _submit(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def _connection(self, config: ServerConfig) -> _Connection:
        conn = self._connections.get(config.key)
        if conn is None:
            conn = self._connections[config.key] = _Connection(config, self._dir)
        return conn

    def tools(self, configs: list[ServerConfig]) -> list[list[dict[str, Any]] | McpUnavailable]:
        """Each server's tools, or why not; the servers are connected to at the same time."""

        async def all_of() -> list[Any]:
            listings = [self._connection(config).list_tools() for config in configs]
            return await asyncio.gather(*listings, return_exceptions=True)

        return self._submit(all_of(), CONNECT_TIMEOUT + 15)  # type: ignore[no-any-return]

    def call(self, config: ServerConfig, tool: str, arguments: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self._submit(  # type: ignore[no-any-return]
            self._connection(config).call(tool, arguments, timeout), timeout + CONNECT_TIMEOUT + 15
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request of a work horse: ``{"op": "tools"|"call", "config", "tool", "arguments", "timeout", "horse"}``."""
        try:
            request = json.loads(await reader.readline())
            config = ServerConfig.of(request["config"]["name"], request["config"]["spec"])
            conn = self._connection(config)
            if request["op"] == "tools":
                reply: dict[str, Any] = {"tools": await conn.list_tools()}
            elif (horse := int(request["horse"])) <= self._ended_through:
                # Written just before its horse died, read only now: its turn is handed over already.
                reply = {"unavailable": f"the call was not made: the work horse that asked for it ({horse}) has ended"}
            else:
                task = asyncio.current_task()
                assert task is not None
                mine = (task, config.key)
                self._by_horse.setdefault(horse, set()).add(mine)
                try:
                    reply = {"result": await conn.call(request["tool"], request["arguments"], request["timeout"])}
                finally:
                    self._by_horse.get(horse, set()).discard(mine)
        except McpUnavailable as exc:
            reply = {"unavailable": str(exc)}
        except asyncio.CancelledError:
            reply = {"unavailable": "the call was ended: the work horse that made it died"}
        except Exception as exc:  # noqa: BLE001 - a malformed request is answered, never kills the hub
            reply = {"unavailable": f"MCP hub: {_describe(exc)}"}
        try:
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
            writer.close()
        except Exception:  # noqa: BLE001,S110 - the horse is gone; nobody reads the reply
            pass

    def end_calls_of(self, horse: int, grace: float) -> None:
        """Once a work horse has ended (before a dead one's turn is handed over): end its calls still in
        flight here, and refuse any it asked for that is read from now on."""

        async def end() -> None:
            self._ended_through = max(self._ended_through, horse)
            calls = self._by_horse.pop(horse, set())
            for key in {key for _task, key in calls if self._connections[key].config.type == "stdio"}:
                await self._connections[key].reset(f"the work horse {horse} died during a call: server stopped")
            for task, _key in calls:
                task.cancel()
            if calls:
                await asyncio.wait([task for task, _key in calls], timeout=grace)

        try:
            self._submit(end(), grace + 15)
        except Exception:
            log.exception("could not end the MCP calls of work horse %d", horse)

    def _remove_dir(self) -> None:
        if os.getpid() == self.pid:  # not in a forked child that happens to exit through atexit
            shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        async def close_all() -> None:
            self._server.close()
            for conn in self._connections.values():
                await conn._close_holder()

        with contextlib.suppress(Exception):
            self._submit(close_all(), 15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(15)
        shutil.rmtree(self._dir, ignore_errors=True)


class HubClient:
    """A work horse's way to its worker's hub (forked from the process that holds it)."""

    def __init__(self, socket_path: str, horse: int) -> None:
        self.socket_path = socket_path
        self.horse = horse  # this horse's number (``next_horse``), which its worker ends its calls by

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(self.socket_path)
                s.sendall(json.dumps({**request, "horse": self.horse}).encode() + b"\n")
                chunks = []
                while not chunks or not chunks[-1].endswith(b"\n"):
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
            reply: dict[str, Any] = json.loads(b"".join(chunks))
        except (OSError, ValueError) as exc:
            raise McpUnavailable(f"this worker's MCP hub did not answer: {type(exc).__name__}: {exc}") from None
        if "unavailable" in reply:
            raise McpUnavailable(reply["unavailable"])
        return reply

    @staticmethod
    def _config(config: ServerConfig) -> dict[str, Any]:
        return {"name": config.name, "spec": config.as_dict()}

    def tools(self, configs: list[ServerConfig]) -> list[list[dict[str, Any]] | McpUnavailable]:
        found: list[list[dict[str, Any]] | McpUnavailable] = []
        for config in configs:  # the hub has them listed already: one local round trip each
            try:
                found.append(self._ask({"op": "tools", "config": self._config(config)}, CONNECT_TIMEOUT + 15)["tools"])
            except McpUnavailable as exc:
                found.append(exc)
        return found

    def call(self, config: ServerConfig, tool: str, arguments: dict[str, Any], timeout: float) -> dict[str, Any]:
        request = {"op": "call", "config": self._config(config), "tool": tool, "arguments": arguments}
        return self._ask({**request, "timeout": timeout}, timeout + CONNECT_TIMEOUT + 15)["result"]  # type: ignore[no-any-return]


_hub: Hub | None = None
_hub_lock = threading.Lock()
_horse = 0  # in a forking worker, the number of its latest horse; in a horse, its own (inherited)


def next_horse() -> int:
    """The number of the work horse a forking worker is about to fork (the horse inherits it): what its
    requests to the hub carry, and what the worker ends its calls by (``Hub.end_calls_of``)."""
    global _horse
    _horse += 1
    return _horse


def hub() -> Hub | HubClient:
    """This process's hub; in a work horse, a client of the hub of the worker it was forked from."""
    global _hub
    with _hub_lock:
        if _hub is not None and _hub.pid != os.getpid():
            return HubClient(_hub.socket_path, _horse)
        if _hub is None:
            _hub = Hub()
        return _hub


def existing_hub() -> Hub | None:
    """The hub this very process runs, if any (a worker without MCP agents has none and imports nothing)."""
    return _hub if _hub is not None and _hub.pid == os.getpid() else None


def _caller(config: ServerConfig, tool: str, timeout: float) -> Callable[[dict[str, Any]], str]:
    def call(arguments: dict[str, Any]) -> str:
        reply = hub().call(config, tool, arguments, timeout)
        if reply["is_error"]:
            raise McpToolFailed(reply["text"])
        return reply["text"]  # type: ignore[no-any-return]

    return call


def attach(agent: Agent) -> None:
    """Give the agent its servers' tools as they are listed now. A server that cannot be reached keeps
    the tools this process listed for it last (a call then fails and reconnects), or has none yet; a
    tool a server no longer lists is gone, so a call of it left by a crash is reconciled as a call of a
    tool the agent no longer has."""
    current: dict[str, list[McpTool]] = {}
    for tool in agent.mcp_tools:
        current.setdefault(tool.server, []).append(tool)
    listings = dict(agent.mcp_listings)
    changed = False
    configs = list(agent.mcp_configs.values())
    for config, listing in zip(configs, hub().tools(configs), strict=True):
        name = config.name
        if isinstance(listing, BaseException):
            log.warning("agent tools of MCP server %s not refreshed: %s", name, listing)
            continue
        if listings.get(name) == listing:
            continue
        changed = True
        listings[name] = listing
        built = []
        for entry in listing:
            timeout = agent.tool_timeout
            tool = build_tool(
                name,
                entry,
                effects=agent.mcp_effects,
                approvals=agent.mcp_requires_approval,
                timeout=timeout,
                caller=_caller(config, str(entry.get("name")), timeout),
            )
            if tool is None:
                log.warning("MCP server %s: tool %r cannot be offered to the model", name, entry.get("name"))
            else:
                built.append(tool)
        current[name] = built
    if changed:
        agent.use_mcp_tools([t for name in agent.mcp_configs for t in current.get(name, [])], listings)
