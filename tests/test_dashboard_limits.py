"""The dashboard under strain, against real processes: Redis (or one shard) down, idle connections that
never finish a request, many open tabs long-polling the live output, a reverse proxy in front of a
token-less dashboard, a token it could never match. The page is checked in headless Chromium."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

from redis import Redis

from agentpool import Shards, enqueue_run, get_run
from agentpool.testing.localpool import free_port

from conftest import ROOT, _redis_server
from test_dashboard import board, dashboard_process, expect  # noqa: F401 - fixtures

AGENT = "pool_agents:support"
ACTIONS = {
    "cancel": {},
    "approve": {"approved": True},
    "resume": {"add_turns": 1},
    "message": {"text": "hi", "message_id": None},
    "fork": {"at_turn": None, "fork_id": None},
}


def without_redis_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "AGENTPOOL_SHARDS")}


def test_with_redis_down_reads_and_actions_are_503_not_a_refusal(tmp_path):
    """The API raises RedisUnreachable, both an AgentPoolError and a redis ConnectionError: it was
    answered 409 "refused by the run's state", and the page said nothing was wrong."""
    server = _redis_server(tmp_path).start()
    try:
        run_id = enqueue_run(AGENT, "wait", connection=Redis.from_url(server.url))
        with dashboard_process({**without_redis_env(), "REDIS_URL": server.url}, tmp_path) as dash:
            server.stop()
            for action, body in ACTIONS.items():
                status, doc = dash.request("POST", f"/api/runs/{run_id}/{action}", body)
                assert status == 503 and doc["error"] == "Redis is unavailable; retrying", (action, status, doc)
            status, doc = dash.request("GET", f"/api/runs/{run_id}")
            assert (status, doc["unavailable"]) == (503, "Redis"), doc
    finally:
        server.stop()


def test_a_run_on_a_stopped_shard_is_503_and_its_page_says_so(tmp_path, browser):
    # Durable (AOF): the stopped shard comes back with its runs.
    dirs = [tmp_path / "shard0", tmp_path / "shard1"]  # an AOF each
    for d in dirs:
        d.mkdir()
    servers = [_redis_server(d, durable=True).start() for d in dirs]
    try:
        urls = [server.url for server in servers]
        # One pool object: new runs go round its shards, so both get some (a fresh object per run starts
        # at a random shard: all eight on one, 1 time in 128).
        pool = Shards(urls)
        made = [enqueue_run(AGENT, "wait", connection=pool) for _ in range(8)]
        on_1 = next(run_id for run_id in made if run_id.endswith("-s1"))
        on_0 = next(run_id for run_id in made if run_id.endswith("-s0"))
        servers[1].stop()
        with dashboard_process({**without_redis_env(), "AGENTPOOL_SHARDS": " ".join(urls)}, tmp_path) as dash:
            status, doc = dash.request("GET", f"/api/runs/{on_1}")
            assert status == 503 and doc["unavailable"] == "shard 1", doc
            assert doc["error"] == "shard 1 is unavailable; retrying", doc
            status, doc = dash.request("POST", f"/api/runs/{on_1}/cancel", {})
            assert status == 503 and doc["unavailable"] == "shard 1", doc
            assert dash.get(f"/api/runs/{on_0}")["run"]["status"] == "queued", "the other shard's runs are served"

            context = browser.new_context()
            try:
                tab = context.new_page()
                tab.set_default_timeout(60_000)
                tab.goto(f"{dash.base}/runs/{on_1}")
                expect(tab.locator("#run-unavailable")).to_have_text(
                    "Cannot read this run: shard 1 is unavailable; retrying"
                )
                expect(tab.locator("#conn")).to_have_text("shard 1 unavailable")
                # The shard comes back: the page reads the run and the notice goes.
                servers[1].start()
                expect(tab.locator("#run-status")).to_have_text("queued")
                expect(tab.locator("#run-unavailable")).to_be_hidden()
                expect(tab.locator("#conn")).to_have_text("live")
            finally:
                context.close()
    finally:
        for server in servers:
            server.stop()


def _idle(
    base: str, n: int, opened: list[socket.socket], start: str = "GET /api/runs HTTP/1.1\r\n"
) -> list[socket.socket]:
    """``n`` connections that each send the start of a request (by default half a request line) and then
    nothing; each is also put in ``opened``, for the test to close."""
    where = urlsplit(base)
    socks = []
    for _ in range(n):
        sock = socket.create_connection((where.hostname, where.port), timeout=10)
        opened.append(sock)
        sock.sendall(start.encode())
        socks.append(sock)
    return socks


def _answer(sock: socket.socket, wait: float) -> bytes | None:
    """What the server sent before closing (b"" if nothing), or None if it still holds the connection."""
    sock.settimeout(wait)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def test_idle_connections_are_dropped_after_the_timeout_and_capped(r, pool, tmp_path):
    """A connection that never finished its request held a thread and a file forever, before any token
    check; enough of them and nobody was served."""
    env = {**pool.env, "AGENTPOOL_DASHBOARD_IDLE_TIMEOUT": "3", "AGENTPOOL_DASHBOARD_MAX_CONNECTIONS": "20"}
    opened: list[socket.socket] = []
    with dashboard_process(env, tmp_path) as dash:
        try:
            held = _idle(dash.base, 15, opened)
            started = time.monotonic()
            assert dash.get("/api/config") == {"token_required": False}, "served beside idle connections"
            time.sleep(0.5)  # the served request's thread gives its place back
            over = _idle(dash.base, 10, opened)  # 25 connections: the last 5 are past the cap of 20
            answers = [_answer(sock, 1) for sock in over]
            busy = [a for a in answers if a is not None and a.startswith(b"HTTP/1.0 503")]
            assert len(busy) == 5 and b"too many connections" in busy[0], answers

            # Within the timeout (3 s, with room for a loaded machine) the server lets the idle ones go.
            assert all(_answer(sock, 15) is not None for sock in held + over)
            assert time.monotonic() - started < 20
            assert dash.get("/api/config") == {"token_required": False}

            # A body that never arrives is cut off too.
            run_id = enqueue_run(AGENT, "wait", connection=r)
            (sock,) = _idle(dash.base, 1, opened, start=f"POST /api/runs/{run_id}/cancel HTTP/1.1\r\n")
            head = (
                f"Host: {urlsplit(dash.base).netloc}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
            )
            sock.sendall(head.encode())
            answer = _answer(sock, 15)
            assert answer is not None and answer.startswith(b"HTTP/1.0 408"), answer
            assert get_run(run_id, connection=r).status == "queued"
        finally:
            for sock in opened:
                sock.close()


def test_many_live_polls_leave_redis_connections_for_reads_and_actions(r, pool, board):  # noqa: F811
    """Each /live long poll held one of the Redis client's 100 pooled connections for 2 s: 100 open tabs
    and every other request was answered 503 "Too many connections"."""
    run_id = enqueue_run(AGENT, "wait", connection=r)
    other = enqueue_run(AGENT, "wait", connection=r)
    answers: Counter[tuple[int, bool]] = Counter()
    stop = time.monotonic() + 8

    def tab() -> None:
        while time.monotonic() < stop:
            status, doc = board.request("GET", f"/api/runs/{run_id}/live")
            answers[status, bool(doc.get("busy"))] += 1
            if status != 200 or doc.get("busy"):
                time.sleep(0.5)  # as the page does

    tabs = [threading.Thread(target=tab) for _ in range(120)]
    for t in tabs:
        t.start()
    try:
        time.sleep(2)  # every tab is polling
        for _ in range(10):
            status, doc = board.request("GET", "/api/runs")
            assert status == 200 and [row["id"] for row in doc["runs"]] == [other, run_id], (status, doc)
            status, doc = board.request("GET", f"/api/runs/{other}")
            assert status == 200 and doc["run"]["status"] == "queued", (status, doc)
            time.sleep(0.2)
        assert board.request("POST", f"/api/runs/{other}/cancel", {}) == (200, {"ok": True, "before": "queued"})
    finally:
        for t in tabs:
            t.join()
    assert set(answers) == {(200, False), (200, True)}, answers


def test_without_a_token_a_request_through_a_proxy_is_refused(r, pool, board, tmp_path):  # noqa: F811
    """A reverse proxy on this machine connects from loopback and may forward a loopback Host: the
    token-less dashboard was open to everyone the proxy serves."""
    run_id = enqueue_run(AGENT, "wait", connection=r)
    for header in ({"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"}):
        status, doc = board.request("POST", f"/api/runs/{run_id}/cancel", {}, headers=header)
        assert status == 403 and "AGENTPOOL_DASHBOARD_TOKEN" in doc["error"], doc
        assert board.request("GET", "/api/runs", headers=header)[0] == 403
    assert get_run(run_id, connection=r).status == "queued"
    with dashboard_process(pool.env, tmp_path, token="proxy-token") as guarded:  # with a token, a proxy is fine
        assert guarded.request("GET", "/api/runs", headers={"X-Forwarded-For": "203.0.113.9"})[0] == 200


def test_a_token_that_is_not_ascii_is_refused_at_start(pool):
    """Headers arrive decoded as Latin-1 and the token was compared as UTF-8: such a token never matched."""
    env = {**pool.env, "AGENTPOOL_DASHBOARD_TOKEN": "pässwörd-123"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentpool", "dashboard", "--port", str(free_port())],
        env=env,
        cwd=str(ROOT),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the dashboard started with a token no client can send") from None
    assert proc.returncode != 0 and "must be ASCII" in err, err


def test_bad_limits_in_the_environment_stop_the_start(pool):
    env = {**pool.env, "AGENTPOOL_DASHBOARD_IDLE_TIMEOUT": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "agentpool", "dashboard", "--port", str(free_port())],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        done.returncode != 0 and "AGENTPOOL_DASHBOARD_IDLE_TIMEOUT must be a finite number > 0, got '0'" in done.stderr
    )
