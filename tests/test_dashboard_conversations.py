"""The dashboard's conversation controls in headless Chromium against a real pool: a message sent from
the run's page (and the messages still waiting for delivery), a fork button; and their HTTP API."""

from __future__ import annotations

from agentpool import enqueue_run, get_run, wait_for_run

from conftest import script_task, wait_for_status
from test_dashboard import board, expect, page  # noqa: F401  (fixtures)

CHAT = [
    {"tool_calls": [{"name": "slow_read", "input": {"seconds": 2.0}}]},
    {"text": "First answer."},
    {"text": "Second answer."},
    {"text": "An answer in the fork."},
]


def test_send_a_message_and_fork_from_the_run_page(r, pool, model, board, page):  # noqa: F811
    model.set_scripts({"chat": CHAT})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    pool.wait_for_effect("slow_read")

    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("running")
    page.fill("#message-text", "While you read: check the invoices.")
    page.click("#send-message")
    expect(page.locator("#talk-feedback")).to_contain_text("Sent")
    # Waiting for delivery at the end of the tool's turn (or already delivered on a slow machine).
    if get_run(run_id, connection=r).inbox:
        expect(page.locator("#inbox li")).to_contain_text("check the invoices")
    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    expect(page.locator("#inbox-box")).to_be_hidden()
    expect(page.locator("#run-result")).to_contain_text("First answer.")

    # A completed run goes on with a message sent from the page.
    page.fill("#message-text", "And the refunds?")
    page.click("#send-message")
    expect(page.locator("#run-result")).to_contain_text("Second answer.", timeout=60_000)
    run = get_run(run_id, connection=r)
    assert run.status == "completed" and run.turns == 3
    assert run.messages[2]["content"][1]["text"] == "While you read: check the invoices."
    assert run.messages[4]["content"] == "And the refunds?"

    # Fork after turn 2 (its copy ends with "And the refunds?" delivered after reply 2): the page opens the fork.
    page.fill("#fork-turn", "2")
    page.click("#fork-run")
    expect(page.locator("#forked-from")).to_have_text(run_id)
    fork_id = page.locator("#run-id").inner_text()
    assert fork_id != run_id
    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    fork = wait_for_run(fork_id, timeout=60, connection=r)
    # The scripted model answers by position: the fork's third reply is the script's third step again.
    assert fork.forked_from == run_id and fork.forked_at == 2 and fork.result == "Second answer."
    page.fill("#message-text", "Go on in the fork.")
    page.click("#send-message")
    expect(page.locator("#run-result")).to_contain_text("An answer in the fork.", timeout=60_000)
    assert sum(1 for e in pool.effects() if e["tool"] == "slow_read") == 1  # the fork ran no tool again
    assert get_run(run_id, connection=r).messages == run.messages
    assert page.errors == []


def test_the_message_and_fork_api(r, pool, model, board):  # noqa: F811
    model.set_scripts({"chat": [{"text": "Hi."}, {"text": "Again."}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("chat"), connection=r)
    wait_for_run(run_id, timeout=60, connection=r)

    for _ in range(2):  # a retried request delivers once
        status, doc = board.request("POST", f"/api/runs/{run_id}/message", {"text": "Hello?", "message_id": "web-1"})
        assert (status, doc) == (200, {"ok": True, "message_id": "web-1"})
    assert wait_for_run(run_id, timeout=60, connection=r, after_message="web-1").result == "Again."
    status, doc = board.request("POST", f"/api/runs/{run_id}/message", {"text": "", "message_id": None})
    assert status == 400 and "non-empty" in doc["error"]
    status, doc = board.request("POST", f"/api/runs/{run_id}/message", {"text": "Other", "message_id": "web-1"})
    assert status == 409 and "already used" in doc["error"]

    status, doc = board.request("POST", f"/api/runs/{run_id}/fork", {"at_turn": 1, "fork_id": "web-fork"})
    assert (status, doc) == (200, {"ok": True, "run_id": "web-fork"})
    status, again = board.request("POST", f"/api/runs/{run_id}/fork", {"at_turn": 1, "fork_id": "web-fork"})
    assert (status, again) == (200, doc)
    status, doc = board.request("POST", f"/api/runs/{run_id}/fork", {"at_turn": "one"})
    assert status == 400
    detail = board.get("/api/runs/web-fork")
    assert detail["run"]["forked_from"] == run_id and detail["run"]["forked_at"] == 1

    waiting = enqueue_run("pool_agents:nowhere", "task", connection=r, check_agent=False)
    wait_for_status(r, waiting, "queued")
    board.request("POST", f"/api/runs/{waiting}/message", {"text": "Queued one.", "message_id": "q1"})
    assert board.get(f"/api/runs/{waiting}")["run"]["inbox"] == [{"id": "q1", "content": "Queued one."}]
    board.request("POST", f"/api/runs/{waiting}/cancel", {})
    status, doc = board.request("POST", f"/api/runs/{waiting}/message", {"text": "Still?", "message_id": None})
    assert status == 409 and "cancelled" in doc["error"]


def test_a_fork_retried_after_a_lost_reply_is_made_once(r, pool, model, board, page):  # noqa: F811
    """The Fork button sent fork_id null: a click again after a network error made a second fork. Its
    id keeps the parent's "-sN" ending (on a sharded pool, the shard the fork lives on)."""
    model.set_scripts({"chat": [{"text": "Hi."}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("chat"), connection=r, run_id="r_chat-s3")
    wait_for_run(run_id, timeout=60, connection=r)
    lost = []

    def lose_the_first_reply(route):  # the request reaches the dashboard; its answer never reaches the page
        if not lost:
            lost.append(route.fetch().json())
            route.abort()
        else:
            route.continue_()

    page.route("**/api/runs/*/fork", lose_the_first_reply)
    page.goto(f"{board.base}/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("completed")
    page.click("#fork-run")
    expect(page.locator("#talk-feedback")).to_contain_text("unreachable")
    page.click("#fork-run")
    expect(page.locator("#forked-from")).to_have_text(run_id)
    fork_id = page.locator("#run-id").inner_text()
    assert fork_id == lost[0]["run_id"] and fork_id.startswith("r_web_") and fork_id.endswith("-s3")
    assert sorted(row["id"] for row in board.get("/api/runs")["runs"]) == sorted([run_id, fork_id])
