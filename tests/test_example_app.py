"""The example FastAPI app (examples/fastapi_app.py), run under uvicorn as a user would, with real
workers, driven from headless Chromium: start a run, see its words stream in over SSE, approve its calls."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from agentpool import approve, get_run
from agentpool.testing.localpool import free_port

from conftest import ROOT, script_task
from test_dashboard import expect, page  # noqa: F401 - fixtures

SCRIPT = [
    {
        "text": "I will deploy version 2.4.1 once you approve.",
        "stream": {"chunk": 4, "interval": 0.03},
        "tool_calls": [{"name": "deploy", "input": {"version": "2.4.1"}}],
    },
    {"text": "Deployed 2.4.1 to production.", "stream": {"chunk": 4, "interval": 0.03}},
]
TWICE = [
    {"text": "First 2.4.1.", "tool_calls": [{"name": "deploy", "input": {"version": "2.4.1"}}]},
    {"text": "Now 2.4.2.", "tool_calls": [{"name": "deploy", "input": {"version": "2.4.2"}}]},
    {"text": "Both deployed."},
]
BOTH_AT_ONCE = [
    {
        "text": "Deploying both.",
        "tool_calls": [
            {"name": "deploy", "input": {"version": "2.4.1"}},
            {"name": "deploy", "input": {"version": "2.4.2"}},
        ],
    },
    {"text": "Both deployed."},
]


@pytest.fixture
def example_app(pool, tmp_path) -> Iterator[str]:
    port = free_port()
    env = {**pool.env, "EXAMPLE_AGENT": "pool_agents:guarded", "PYTHONPATH": str(ROOT / "examples")}
    with open(tmp_path / "example.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "fastapi_app:app", "--port", str(port)],
            env=env,
            cwd=str(ROOT / "examples"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "example.log").read_text()
                time.sleep(0.1)
        try:
            yield base
        finally:
            proc.terminate()
            proc.wait(30)


def test_the_example_app_starts_a_run_streams_it_and_takes_an_approval(r, pool, model, example_app, page):
    model.set_scripts({"deploy": SCRIPT})
    pool.start(1)
    page.goto(example_app + "/")
    page.fill("#task", script_task("deploy", "Deploy the release"))
    page.click("#start button")
    expect(page.locator("#status")).to_have_text("waiting_approval", timeout=120_000)
    expect(page.locator("#output")).to_have_text("I will deploy version 2.4.1 once you approve.")
    approval = page.locator(".approval")
    expect(approval).to_contain_text('deploy {"version":"2.4.1"}')
    assert [e["tool"] for e in pool.effects()] == [], "nothing deployed before the decision"
    approval.get_by_role("button", name="Approve").click()
    expect(page.locator("#result")).to_have_text("Deployed 2.4.1 to production.", timeout=120_000)
    expect(page.locator("#status")).to_have_text("completed")
    # The first call's words once (the live stream still held them when the page followed again).
    expect(page.locator("#output")).to_have_text(
        "I will deploy version 2.4.1 once you approve.Deployed 2.4.1 to production."
    )
    assert [e["tool"] for e in pool.effects()] == ["deploy"]
    assert page.errors == []


def test_the_page_shows_the_next_approval_the_run_reached_before_the_page_followed_again(
    r, pool, model, example_app, page
):
    model.set_scripts({"deploy": TWICE})
    pool.start(1)
    follows = []

    def late(route) -> None:
        """The page's stream after a decision connects only once the run has stopped again."""
        follows.append(route.request.url)
        run_id = route.request.url.split("/runs/")[1].split("/")[0]
        deadline = time.monotonic() + 60
        while len(follows) > 1 and get_run(run_id, connection=r).status in ("queued", "running"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        route.continue_()

    page.route("**/events*", late)
    page.goto(example_app + "/")
    page.fill("#task", script_task("deploy", "Deploy both"))
    page.click("#start button")
    for version in ("2.4.1", "2.4.2"):
        approval = page.locator(".approval")
        expect(approval).to_contain_text(f'deploy {{"version":"{version}"}}', timeout=120_000)
        expect(page.locator("#status")).to_have_text("waiting_approval")
        approval.get_by_role("button", name="Approve").click()
    expect(page.locator("#result")).to_have_text("Both deployed.", timeout=120_000)
    expect(page.locator("#output")).to_have_text("First 2.4.1.Now 2.4.2.Both deployed.")
    assert len(follows) == 3 and [e["tool"] for e in pool.effects()] == ["deploy", "deploy"]
    assert page.errors == []


def test_after_deciding_one_of_two_calls_the_page_shows_the_other(r, pool, model, example_app, page):
    model.set_scripts({"deploy": BOTH_AT_ONCE})
    pool.start(1)
    page.goto(example_app + "/")
    page.fill("#task", script_task("deploy", "Deploy both"))
    page.click("#start button")
    expect(page.locator(".approval")).to_have_count(2, timeout=120_000)
    page.locator(".approval").first.get_by_role("button", name="Approve").click()
    expect(page.locator(".approval")).to_have_text(['deploy {"version":"2.4.2"} ApproveDeny'])
    expect(page.locator("#status")).to_have_text("waiting_approval")
    page.locator(".approval").get_by_role("button", name="Approve").click()
    expect(page.locator("#result")).to_have_text("Both deployed.", timeout=120_000)
    expect(page.locator("#output")).to_have_text("Deploying both.Both deployed.")
    assert page.errors == []


def test_a_call_decided_elsewhere_says_so_on_the_page_which_follows_the_run_on(r, pool, model, example_app, page):
    model.set_scripts({"deploy": SCRIPT})
    pool.start(1)
    page.goto(example_app + "/")
    page.fill("#task", script_task("deploy", "Deploy the release"))
    page.click("#start button")
    expect(page.locator("#status")).to_have_text("waiting_approval", timeout=120_000)
    run_id = page.locator("#run").text_content()
    approve(run_id, connection=r)  # another tab, another person
    page.locator(".approval").get_by_role("button", name="Deny").click()
    expect(page.locator("#error")).to_contain_text(f"Not decided: run {run_id} is ")
    expect(page.locator("#error")).to_contain_text("was approved already, by person")
    expect(page.locator("#result")).to_have_text("Deployed 2.4.1 to production.", timeout=120_000)
    expect(page.locator("#output")).to_have_text(
        "I will deploy version 2.4.1 once you approve.Deployed 2.4.1 to production."
    )
    assert [e["tool"] for e in pool.effects()] == ["deploy"]

    def decide(run: str) -> tuple[int, str]:
        body = json.dumps({"tool_use_id": "toolu_x", "approved": True}).encode()
        request = urllib.request.Request(
            f"{example_app}/runs/{run}/approve", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as res:
                return res.status, res.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())["detail"]

    assert decide(run_id) == (409, f"run {run_id} is completed, not waiting for approval")
    assert decide("r_nothere") == (404, "no run r_nothere")
