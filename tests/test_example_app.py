"""The example FastAPI app (examples/fastapi_app.py), run under uvicorn as a user would, with real
workers, driven from headless Chromium: start a run, see its words stream in over SSE, approve its call."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

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
    expect(page.locator("#output")).to_contain_text("I will deploy version 2.4.1 once you approve.", timeout=120_000)
    expect(page.locator("#status")).to_have_text("waiting_approval", timeout=60_000)
    approval = page.locator(".approval")
    expect(approval).to_contain_text('deploy {"version":"2.4.1"}')
    assert [e["tool"] for e in pool.effects()] == [], "nothing deployed before the decision"
    approval.get_by_role("button", name="Approve").click()
    expect(page.locator("#result")).to_have_text("Deployed 2.4.1 to production.", timeout=120_000)
    expect(page.locator("#status")).to_have_text("completed")
    assert [e["tool"] for e in pool.effects()] == ["deploy"]
    assert page.errors == []
