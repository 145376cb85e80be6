"""The dashboard's live output and timeline: its JSON API (a long poll for the model's words, a timeline
built from the recorded events) and the run page in headless Chromium, as in tests/test_dashboard.py."""

from __future__ import annotations

import time

import pytest

from agentpool import approve, enqueue_run, get_run, wait_for_run
from agentpool.store.events import MAX_EVENTS
from agentpool.store.keys import RunKeys

from conftest import script_task
from test_dashboard import board, dashboard_process, expect, page, wait_status  # noqa: F401 - fixtures

ANSWER = "The release ships on Friday; Ana owns the changelog and the team has been told."
HOSTILE_LIVE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script> and plain words'
PAYMENT = [
    {
        "error": {"status": 529, "type": "overloaded_error", "message": "Overloaded", "times": 1},
        "text": "I will pay the invoice.",
        "tool_calls": [{"name": "wire_money", "input": {"amount_cents": 1250, "to": "ACME"}}],
    },
    {"text": "Paid."},
]


def pages(n: int) -> list[dict]:
    return [{"tool_calls": [{"name": "read_page", "input": {"page": i}}]} for i in range(n)] + [{"text": "All read."}]


def test_live_api_long_polls_the_words_of_the_call_in_flight(r, pool, model, board):
    model.set_scripts({"live": [{"text": ANSWER, "stream": {"chunk": 3, "interval": 0.04}}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("live"), connection=r)
    after, entries = "0-0", []
    deadline = time.monotonic() + 60
    while get_run(run_id, connection=r).status != "completed" or after == "0-0":
        assert time.monotonic() < deadline
        doc = board.get(f"/api/runs/{run_id}/live?after={after}")
        entries += doc["entries"]
        after = doc["last"]
    text = "".join(e["text"] for e in entries if e["type"] == "text_delta")
    assert text == ANSWER and entries[0]["type"] == "call_start" and entries[0]["turn"] == 0
    assert len([e for e in entries if e["type"] == "text_delta"]) > 3, "it arrived in pieces, while it streamed"
    assert board.request("GET", f"/api/runs/{run_id}/live?after=x")[0] == 400
    assert board.request("GET", "/api/runs/r_nope/live")[0] == 404


def test_live_and_timeline_need_the_token(r, pool, tmp_path):
    run_id = enqueue_run("pool_agents:support", "wait", connection=r)
    with dashboard_process(pool.env, tmp_path, "--host", "0.0.0.0", token="tl-token") as guarded:
        for path in (f"/api/runs/{run_id}/live", f"/api/runs/{run_id}/timeline"):
            assert guarded.request("GET", path, token="wrong")[0] == 401
            assert guarded.request("GET", path)[0] == 200


def test_timeline_shows_model_tools_waits_and_compactions_per_turn(r, pool, model, board):
    model.set_scripts({"payment": PAYMENT, "pages": pages(8)})
    pool.start(1)
    paid = enqueue_run("test_dashboard:approving", script_task("payment"), connection=r)
    wait_status(r, paid, "waiting_approval")
    time.sleep(0.3)  # a visible wait
    approve(paid, connection=r)
    paid_run = wait_for_run(paid, timeout=60, connection=r)
    read = wait_for_run(
        enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r),
        timeout=120,
        connection=r,
    )
    assert paid_run.status == read.status == "completed"

    rows = board.get(f"/api/runs/{paid}/timeline")["turns"]
    assert [row["turn"] for row in rows] == [0, 1]
    assert [wait["kind"] for wait in rows[0]["waits"]] == ["backoff", "approval"]
    assert all(w["end"] > w["start"] for w in rows[0]["waits"]) and rows[0]["errors"] == 1
    assert [tool["name"] for tool in rows[0]["tools"]] == ["wire_money"] and rows[0]["tools"][0]["end"]
    assert all(len(row["model"]) == 1 and row["model"][0]["end"] > row["model"][0]["start"] for row in rows)
    assert sum(row["tokens"] for row in rows) == paid_run.total_tokens
    assert sum(row["cost_usd"] for row in rows) == pytest.approx(paid_run.cost_usd)

    rows = board.get(f"/api/runs/{read.id}/timeline")["turns"]
    compactions = [c for row in rows for c in row["compactions"]]
    assert compactions and {c["mode"] for c in compactions} == {"summary"}
    assert sum(row["tokens"] for row in rows) == read.total_tokens, "summary calls are counted in their turn"


def test_timeline_of_a_long_run_shows_its_latest_turns(r, pool, board):
    """The events stream is trimmed about at 1,000 entries (whole nodes of it at a time), so it may hold
    more: the timeline says it is drawn from the most recent events, and its last turn is the run's."""
    run_id = enqueue_run("pool_agents:support", "wait", connection=r)  # no worker: only the events below
    stream = RunKeys.of(run_id).events
    for turn in range(400):
        for kind in ("turn_started", "model_responded", "turn_committed"):
            r.xadd(stream, {"kind": kind, "turn": str(turn), "seconds": "0"}, maxlen=MAX_EVENTS, approximate=True)
    assert r.xlen(stream) > MAX_EVENTS, "the stream keeps more than the cap: the case this test is about"
    doc = board.get(f"/api/runs/{run_id}/timeline")
    assert doc["events"] == MAX_EVENTS and doc["turns"][-1]["turn"] == 399


def test_run_page_shows_the_words_live_then_the_timeline(r, pool, model, board, page):
    model.set_scripts(
        {
            "live": [
                {"text": "Reading.", "tool_calls": [{"name": "read_notes", "input": {"topic": "x"}}]},
                {"text": HOSTILE_LIVE + " " + ANSWER, "stream": {"chunk": 3, "interval": 0.05}},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("live"), connection=r)
    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#live-output")).to_contain_text("and plain", timeout=30_000)
    assert get_run(run_id, connection=r).status == "running", "seen while the model was still writing"
    expect(page.locator("#live-title")).to_contain_text("turn 1")
    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    expect(page.locator("#live-output")).to_contain_text(ANSWER)
    expect(page.locator("#live-output")).to_contain_text('<img src=x onerror="window.pwned=1">')
    expect(page.locator("#timeline g.tl-row")).to_have_count(2)
    expect(page.locator("#timeline rect.tl-tool")).to_have_count(1)
    assert page.locator("#app img, #app script").count() == 0
    assert page.evaluate("window.pwned") is None
    assert page.errors == []


def test_run_page_marks_where_the_next_request_starts(r, pool, model, board, page):
    model.set_scripts({"pages": pages(8)})
    pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r),
        timeout=120,
        connection=r,
    )
    assert run.status == "completed" and run.window_start > 0
    page.goto(f"{board.base}/runs/{run.id}")
    expect(page.locator("#conversation .msg")).to_have_count(len(run.messages))
    marker_next = page.locator("#window-marker + article")
    expect(marker_next).to_have_attribute("data-index", str(run.window_start))
    expect(page.locator("#timeline rect.tl-compaction")).not_to_have_count(0)
    assert page.errors == []
