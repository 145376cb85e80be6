"""`agentpool dashboard`: its JSON API over HTTP, and the page itself in headless Chromium, against a
real pool. The browser is Debian's /usr/bin/chromium driven by playwright (no browser download)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentpool import Agent, enqueue_run, get_run, tool, wait_for_run
from agentpool.testing.localpool import free_port

from conftest import ROOT, script_task
from pool_agents import record

MEETING = [
    {"text": "Let me read the notes.", "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {
        "tool_calls": [
            {"name": "create_ticket", "input": {"title": "Changelog", "body": "Ana writes it"}},
            {"name": "flaky_lookup", "input": {"item": "boom"}},
            {
                "name": "send_email",
                "input": {"to": "team@example.com", "subject": "Release Friday", "body": "See ticket."},
            },
        ]
    },
    {"text": "The release ships Friday; a ticket is open and the team is told."},
]
SLOW = [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 30}}]}, {"text": "Too late."}]
HOSTILE = [
    {
        "text": '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>',
        "tool_calls": [{"name": "read_notes", "input": {"topic": '<b onmouseover="window.pwned=3">bold</b>'}}],
    },
    {"text": "</pre><iframe src=javascript:window.pwned=4></iframe>"},
]


# An agent whose tool needs a person's approval; the workers import it from this module.
@tool(effect="unsafe", requires_approval=True)
def wire_money(amount_cents: int, to: str) -> str:
    """Send money to an account; a person approves each transfer."""
    record("wire_money", amount=amount_cents, to=to)
    return f"wired {amount_cents} cents to {to}"


approving = Agent(model="claude-sonnet-5-5", system="Ask before paying.", tools=[wire_money], max_turns=6)
PAYMENT = [
    {
        "text": "I will pay the invoice.",
        "tool_calls": [{"name": "wire_money", "input": {"amount_cents": 1250, "to": "ACME"}}],
    },
    {"text": "Paid."},
]


# -- the dashboard process -----------------------------------------------------------------------


class Dashboard:
    def __init__(self, base: str, token: str | None = None) -> None:
        self.base, self.token = base, token

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        token: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        if token or self.token:
            hdrs["Authorization"] = f"Bearer {token or self.token}"
        hdrs.update(headers or {})
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            with err:
                return err.code, json.loads(err.read() or b"{}")

    def get(self, path: str, **kw: Any) -> dict[str, Any]:
        status, doc = self.request("GET", path, **kw)
        assert status == 200, (status, doc)
        return doc


@contextmanager
def dashboard_process(env: dict[str, str], tmp: Path, *args: str, token: str | None = None) -> Iterator[Dashboard]:
    port = free_port()
    env = {**env, **({"AGENTPOOL_DASHBOARD_TOKEN": token} if token else {})}
    with open(tmp / f"dashboard-{port}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentpool", "dashboard", "--port", str(port), *args],
            env=env,
            cwd=str(ROOT),
            stdout=log,
            stderr=log,
        )
        try:
            board = Dashboard(f"http://127.0.0.1:{port}", token)
            deadline = time.monotonic() + 120  # a Python process starting on a loaded machine
            while True:
                try:
                    board.request("GET", "/api/config")
                    break
                except (urllib.error.URLError, ConnectionError):
                    assert proc.poll() is None and time.monotonic() < deadline, (
                        tmp / f"dashboard-{port}.log"
                    ).read_text()
                    time.sleep(0.1)
            yield board
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def dashboard_start(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``agentpool dashboard`` run to its end: for a start it must refuse (one that serves times out)."""
    return subprocess.run(
        [sys.executable, "-m", "agentpool", "dashboard", "--port", str(free_port()), *args],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def board(pool, tmp_path) -> Iterator[Dashboard]:
    with dashboard_process(pool.env, tmp_path) as b:
        yield b


def wait_status(r, run_id: str, status: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (now := get_run(run_id, connection=r).status) != status:
        assert time.monotonic() < deadline, f"run {run_id} is {now}, never became {status}"
        time.sleep(0.1)


def wait_effect(pool, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["tool"] == name for e in pool.effects()):
        assert time.monotonic() < deadline, f"{name} never ran"
        time.sleep(0.05)


# -- the JSON API ----------------------------------------------------------------------------------


def test_api_lists_runs_and_serves_conversation_ledger_and_events(r, pool, model, board):
    model.set_scripts({"meeting": MEETING})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r)
    other = enqueue_run("pool_agents:short", script_task("meeting"), connection=r, max_turns=1)
    wait_for_run(other, timeout=60, connection=r)

    listed = board.get("/api/runs")["runs"]
    assert [row["id"] for row in listed] == [other, run_id]
    row = listed[1]
    assert (row["status"], row["turns"], row["tokens"], row["agent"]) == (
        "completed",
        3,
        run.total_tokens,
        "pool_agents:support",
    )
    assert [x["id"] for x in board.get("/api/runs?status=completed")["runs"]] == [run_id]
    assert [x["id"] for x in board.get("/api/runs?agent=pool_agents:short")["runs"]] == [other]
    assert board.get("/api/runs?status=failed")["runs"] == []

    doc = board.get(f"/api/runs/{run_id}")
    assert doc["run"]["status"] == "completed" and doc["run"]["result"] == run.result
    assert doc["messages"] == run.messages and doc["message_count"] == 6
    assert "messages" not in doc["run"]
    ledger = {e["name"]: e for e in doc["ledger"].values()}
    assert {name: e["effect"] for name, e in ledger.items()} == {
        "read_notes": "read",
        "create_ticket": "idempotent",
        "flaky_lookup": "read",
        "send_email": "unsafe",
    }
    assert [name for name, e in ledger.items() if e["outcome"]["is_error"]] == ["flaky_lookup"]
    assert ledger["send_email"]["outcome"]["how"] == "ran" and "owner" not in ledger["send_email"]

    tail = board.get(f"/api/runs/{run_id}?from=4")
    assert tail["messages"] == run.messages[4:] and tail["messages_from"] == 4 and tail["message_count"] == 6

    events = board.get(f"/api/runs/{run_id}/events")["events"]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "status" and kinds[-1] == "status" and kinds.count("tool_started") == 4
    assert board.get(f"/api/runs/{run_id}/events?after={events[-2]['id']}")["events"] == events[-1:]

    assert board.request("GET", "/api/runs/r_nope")[0] == 404
    assert board.request("GET", "/api/runs?limit=x")[0] == 400
    assert board.request("GET", "/api/runs/../../etc/passwd")[0] == 404


def test_api_cancel_ends_a_running_run(r, pool, model, board):
    model.set_scripts({"slow": SLOW})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    wait_effect(pool, "slow_read")

    status, doc = board.request("POST", f"/api/runs/{run_id}/cancel", {})

    assert (status, doc) == (200, {"ok": True, "before": "running"})
    assert get_run(run_id, connection=r).status == "cancelled"
    assert board.get(f"/api/runs/{run_id}")["run"]["error"] == "cancelled from the dashboard"


def test_actions_must_be_json_from_this_origin_and_host(r, board):
    run_id = enqueue_run("pool_agents:support", "wait", connection=r)
    path = f"/api/runs/{run_id}/cancel"
    # a cross-site form can post text/plain without a CORS preflight: refused
    assert board.request("POST", path, "x", headers={"Content-Type": "text/plain"})[0] == 415
    assert board.request("POST", path, {}, headers={"Origin": "http://evil.example"})[0] == 403
    # a DNS-rebinding page reaches 127.0.0.1 under its own host name: refused, reads included
    assert board.request("GET", "/api/runs", headers={"Host": "evil.example"})[0] == 403
    assert board.request("POST", f"/api/runs/{run_id}/launch", {})[0] == 404
    assert get_run(run_id, connection=r).status == "queued"
    assert board.request("POST", path, {}, headers={"Origin": board.base})[0] == 200


def test_a_body_length_that_is_not_a_byte_count_is_refused_unread(r, board):
    """Content-Length: -1 would make the server read until the client stops sending: no size limit."""
    import socket
    from urllib.parse import urlsplit

    run_id = enqueue_run("pool_agents:support", "wait", connection=r)
    where = urlsplit(board.base)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        head = (
            f"POST /api/runs/{run_id}/cancel HTTP/1.1\r\nHost: {where.netloc}\r\n"
            "Content-Type: application/json\r\nContent-Length: -1\r\n\r\n{}"
        )
        sock.sendall(head.encode())
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), reply[:200]
    assert get_run(run_id, connection=r).status == "queued"


def test_beyond_localhost_it_needs_a_token_and_every_api_call_carries_it(r, pool, tmp_path):
    refused = dashboard_start(
        {k: v for k, v in pool.env.items() if k != "AGENTPOOL_DASHBOARD_TOKEN"}, "--host", "0.0.0.0", timeout=30
    )
    assert refused.returncode != 0 and "AGENTPOOL_DASHBOARD_TOKEN" in refused.stderr

    run_id = enqueue_run("pool_agents:support", "wait", connection=r)
    with dashboard_process(pool.env, tmp_path, "--host", "0.0.0.0", token="s3cret-token") as board:
        assert board.request("GET", "/api/config", token="-")[1] == {"token_required": True}
        assert board.request("GET", "/api/runs", token="wrong")[0] == 401
        assert board.request("POST", f"/api/runs/{run_id}/cancel", {}, token="wrong")[0] == 401
        assert get_run(run_id, connection=r).status == "queued"
        assert board.get("/api/runs")["runs"][0]["id"] == run_id
        assert board.request("POST", f"/api/runs/{run_id}/cancel", {})[0] == 200
    assert get_run(run_id, connection=r).status == "cancelled"


def test_each_person_has_a_token_of_their_own_and_what_they_do_is_recorded_under_their_name(r, pool, model, tmp_path):
    """``AGENTPOOL_DASHBOARD_TOKENS``: one token per person. An approval names whose token decided (the
    decision and the run's ``approval`` event), a cancelled run's error and event say who cancelled it, a
    message's and a fork's events who sent or forked, and the dashboard's log lists every action with its
    name, never a token."""
    from agentpool.store import events

    alice, bob = "alice-" + "a" * 20, "bob-" + "b" * 20
    model.set_scripts(
        {
            "deploy": [
                {"tool_calls": [{"name": "deploy", "input": {"version": "9"}}]},
                {"text": "ok"},
                {"text": "answered"},
            ]
        }
    )
    pool.start(1)
    guarded = enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r)
    other = enqueue_run("pool_agents:guarded", "no worker serves this queue", queue="nobody", connection=r)
    wait_status(r, guarded, "waiting_approval")
    env = {**pool.env, "AGENTPOOL_DASHBOARD_TOKENS": f"alice={alice}, bob={bob}"}
    with dashboard_process(env, tmp_path, "--host", "0.0.0.0") as board:
        assert board.request("GET", "/api/config")[1] == {"token_required": True}
        assert board.request("GET", "/api/runs")[0] == 401, "no token"
        assert board.request("POST", f"/api/runs/{other}/cancel", {}, token="alice-" + "x" * 20)[0] == 401
        assert board.request("GET", "/api/runs", token=alice)[0] == 200
        approved = {"approved": True}
        assert board.request("POST", f"/api/runs/{guarded}/approve", approved, token=bob)[0] == 200
        assert board.request("POST", f"/api/runs/{other}/cancel", {}, token=alice)[0] == 200
        assert wait_for_run(guarded, timeout=60, connection=r).status == "completed"
        status, sent = board.request("POST", f"/api/runs/{guarded}/message", {"text": "And then?"}, token=bob)
        assert status == 200, sent
        status, forked = board.request("POST", f"/api/runs/{guarded}/fork", {}, token=alice)
        assert status == 200, forked
    (decision,) = [f for _, f in events.read(r, guarded) if f["kind"] == "approval"]
    assert decision["by"] == "bob" and decision["approved"] == "True", decision
    cancelled = get_run(other, connection=r)
    assert cancelled.status == "cancelled" and cancelled.error == "cancelled from the dashboard by alice", cancelled

    def who(run: str, kind: str, status: str | None = None) -> list[str | None]:
        return [f.get("by") for _, f in events.read(r, run) if f["kind"] == kind and status in (None, f["status"])]

    assert who(other, "status", "cancelled") == ["alice"]
    assert who(guarded, "status", "running")[-1] == "bob", "the message that set the completed run going"
    assert who(forked["run_id"], "forked") == ["alice"]
    (log,) = tmp_path.glob("dashboard-*.log")
    said = log.read_text()
    assert f"approve on run {guarded} by bob" in said and f"cancel on run {other} by alice" in said, said
    assert f"message on run {guarded} by bob" in said and f"fork on run {guarded} by alice" in said, said
    assert alice not in said and bob not in said, "a token in the log"


@pytest.mark.parametrize(
    ("tokens", "says"),
    [
        ({"AGENTPOOL_DASHBOARD_TOKENS": "alice=short"}, "alice's token must be at least 16"),
        ({"AGENTPOOL_DASHBOARD_TOKENS": "alice"}, "entry 1 is not name=token"),
        ({"AGENTPOOL_DASHBOARD_TOKENS": f"alice={'a' * 16},bob={'a' * 16}"}, "bob's token is another name's too"),
        ({"AGENTPOOL_DASHBOARD_TOKENS": f"al ice={'a' * 16}"}, "entry 1 is not name=token"),
        ({"AGENTPOOL_DASHBOARD_TOKENS": f"alice={'a' * 16}", "AGENTPOOL_DASHBOARD_TOKEN": "one-for-all"}, "not both"),
    ],
)
def test_named_tokens_that_cannot_work_stop_the_start_without_showing_a_token(pool, tokens, says):
    out = dashboard_start({**pool.env, **tokens})
    assert out.returncode != 0 and says in out.stderr, out.stderr
    assert "a" * 16 not in out.stderr


# -- the page, in headless Chromium ------------------------------------------------------------------


@pytest.fixture
def page(browser) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.on("console", lambda msg: msg.type == "error" and page.errors.append(msg.text))
    yield page
    context.close()


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


def test_page_lists_a_run_and_follows_it_to_completed(r, pool, model, board, page):
    model.set_scripts({"meeting": [{**MEETING[0], "delay": 1.5}, *MEETING[1:]]})
    page.goto(board.base + "/")
    expect(page.locator("#runs-table td.empty")).to_contain_text("No runs yet")
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)

    row = page.locator(f'#runs-table tr[data-run-id="{run_id}"]')
    expect(row.locator("td.status")).to_have_text("completed", timeout=60_000)
    expect(row.locator("td.turns")).to_have_text("3")

    page.select_option("#filter-status", "failed")
    expect(page.locator("#runs-table td.empty")).to_contain_text("No runs match")
    page.select_option("#filter-status", "completed")
    expect(row).to_be_visible()
    row.locator("a").click()
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("#conversation .msg")).to_have_count(6)
    expect(page.locator("#conversation .tool-result.is-error")).to_contain_text("the lookup service is down")
    expect(page.locator("#ledger-table tbody tr")).to_have_count(4)
    expect(page.locator("#events li").first).to_contain_text("status=completed")
    assert page.errors == []


def test_run_page_nests_the_child_runs_of_a_sub_agent_tree(r, pool, model, board, page):
    research = {
        f"research{i}": [{"tool_calls": [{"name": "read_notes", "input": {"topic": f"t{i}"}}]}, {"text": f"answer {i}"}]
        for i in range(2)
    }
    delegate = [{"name": "researcher", "input": {"task": f"Look into {i} [script:research{i}]"}} for i in range(2)]
    model.set_scripts(
        {
            "lead": [
                {"tool_calls": [{"name": "manager", "input": {"task": "Manage it [script:manage]"}}]},
                {"text": "led"},
            ],
            "manage": [{"tool_calls": delegate}, {"text": "managed"}],
            **research,
        }
    )
    pool.start(2)
    lead = enqueue_run("subagent_agents:lead", script_task("lead"), connection=r)
    assert wait_for_run(lead, timeout=180, connection=r).status == "completed"
    (manager,) = get_run(lead, connection=r).children

    page.goto(f"{board.base}/runs/{lead}")
    rows = page.locator("#child-runs tr.child-run")
    expect(rows).to_have_count(3)
    expect(rows.first).to_have_attribute("data-run-id", manager)
    # The page's CSP (style-src 'self') refuses inline style attributes: the indentation is set through
    # CSSOM, so a grandchild sits further right than its parent and the browser reports no violation.
    indent = [
        float(cell.evaluate("td => getComputedStyle(td).paddingLeft").removesuffix("px"))
        for cell in rows.locator("td:first-child").all()
    ]
    assert indent[1] == indent[2] > indent[0], indent
    assert page.errors == []


def test_run_page_screenshot(r, pool, model, board, page, tmp_path):
    model.set_scripts({"meeting": MEETING})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("meeting"), connection=r)
    wait_for_run(run_id, timeout=60, connection=r)

    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#conversation .msg")).to_have_count(6)
    expect(page.locator("#events li")).not_to_have_count(0)
    shot = tmp_path / "run-page.png"
    page.screenshot(path=str(shot), full_page=True)

    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width == 1280 and height > 1200, (width, height)  # the whole conversation, not a blank viewport
    assert len(png) > 60_000, len(png)
    assert page.errors == []


def test_untrusted_text_is_shown_as_text_never_as_markup(r, pool, model, board, page):
    model.set_scripts({"hostile": HOSTILE})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("hostile"), connection=r)
    wait_for_run(run_id, timeout=60, connection=r)

    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("#conversation")).to_contain_text('<img src=x onerror="window.pwned=1">')
    expect(page.locator("#conversation")).to_contain_text('"topic": "<b onmouseover')
    assert page.locator("#app img, #app script, #app iframe, #app b").count() == 0
    assert page.evaluate("window.pwned") is None


def test_cancel_through_the_page(r, pool, model, board, page):
    model.set_scripts({"slow": SLOW})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("slow"), connection=r)
    wait_effect(pool, "slow_read")

    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("running")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button[data-action=cancel]")

    expect(page.locator("#run-status")).to_have_text("cancelled")
    expect(page.locator("#action-feedback")).to_have_text("Cancelled.")
    expect(page.locator("button[data-action=cancel]")).to_have_count(0)
    assert get_run(run_id, connection=r).status == "cancelled"


def test_token_from_the_url_is_kept_for_the_tab_and_taken_out_of_the_address(r, pool, page, tmp_path):
    run_id = enqueue_run("pool_agents:support", "wait", connection=r)
    with dashboard_process(pool.env, tmp_path, token="tab-token") as board:
        page.goto(board.base + "/")
        expect(page.locator("#token-input")).to_be_visible()
        page.goto(board.base + "/?token=tab-token")
        expect(page.locator(f'#runs-table tr[data-run-id="{run_id}"] td.status')).to_have_text("queued")
        assert "token" not in page.url
        assert page.evaluate("sessionStorage.getItem('agentpool.dashboard.token')") == "tab-token"


def test_approve_in_the_page_lets_a_paused_run_finish(r, pool, model, board, page):
    model.set_scripts({"payment": PAYMENT})
    pool.start(1)
    run_id = enqueue_run("test_dashboard:approving", script_task("payment"), connection=r)
    wait_status(r, run_id, "waiting_approval")
    paused = get_run(run_id, connection=r)
    assert [call["name"] for call in paused.pending] == ["wire_money"]
    assert not any(e["tool"] == "wire_money" for e in pool.effects()), "nothing runs before the decision"

    status, refused = board.request("POST", f"/api/runs/{run_id}/approve", {})  # says neither yes nor no
    assert status == 400 and "approved (bool, required)" in refused["error"], refused
    assert get_run(run_id, connection=r).status == "waiting_approval", "a body that does not say decides nothing"

    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("waiting_approval")
    expect(page.locator(".approval")).to_contain_text('"amount_cents": 1250')
    page.click(f'button[data-action=approve][data-tool-use-id="{paused.pending[0]["id"]}"]')

    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    assert [e["tool"] for e in pool.effects()] == ["wire_money"]
    assert get_run(run_id, connection=r).result == "Paid."


def test_deny_in_the_page_sends_the_reason_to_the_model_and_nothing_runs(r, pool, model, board, page):
    model.set_scripts({"payment": PAYMENT})
    pool.start(1)
    run_id = enqueue_run("test_dashboard:approving", script_task("payment"), connection=r)
    wait_status(r, run_id, "waiting_approval")

    page.goto(f"{board.base}/runs/{run_id}")
    page.fill(".pending-call .reason", "wrong account")
    page.click("button[data-action=deny]")

    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    expect(page.locator("#conversation .tool-result.is-error")).to_contain_text("wrong account")
    assert not any(e["tool"] == "wire_money" for e in pool.effects())


def test_resume_in_the_page_continues_a_stopped_run(r, pool, model, board, page):
    model.set_scripts({"meeting": MEETING})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("meeting"), connection=r, max_turns=2)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "stopped"

    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("stopped")
    expect(page.locator("#resume-turns")).to_have_value("10")  # it stopped at max_turns
    page.click("button[data-action=resume]")

    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    assert get_run(run_id, connection=r).turns == 3


def test_a_run_that_is_not_moving_says_why_and_since_when(r, pool, model, board, page):
    from agentpool.store import handback
    from agentpool.store.keys import RunKeys

    pool.start(1)
    run_id = enqueue_run(
        "not_deployed_here:agent", script_task("meeting"), connection=r, check_agent=False
    )  # no worker has it
    deadline = time.monotonic() + 30
    while handback.read(r, RunKeys.of(run_id)) is None:
        assert time.monotonic() < deadline, "the turn was never handed back"
        time.sleep(0.05)

    waiting = board.get(f"/api/runs/{run_id}")["run"]["waiting"]
    assert waiting["kind"] == "handed_back" and waiting["reason"] == "agent_not_loadable" and waiting["since"]
    row = next(row for row in board.get("/api/runs")["runs"] if row["id"] == run_id)
    assert "handed back" in row["note"] and "cannot load" in row["note"]

    page.goto(board.base + "/")
    expect(page.locator(f'#runs-table tr[data-run-id="{run_id}"] td.note-cell')).to_contain_text("handed back")
    page.goto(f"{board.base}/runs/{run_id}")
    callout = page.locator("#run-waiting")
    expect(callout).to_contain_text("Handed back")
    expect(callout).to_contain_text("cannot import module 'not_deployed_here'")
    expect(callout).to_contain_text("since")
    assert page.errors == []
