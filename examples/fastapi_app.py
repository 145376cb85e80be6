"""An asyncio app on agentpool: FastAPI starts runs, streams a run's live output to the browser over
server-sent events, and takes a person's approvals. Everything it asks of Redis goes through
``agentpool.aio`` on one ``redis.asyncio`` client, so no request blocks the event loop.

    pip install 'agentpool[aio]' fastapi uvicorn
    REDIS_URL=redis://localhost:6379/0 EXAMPLE_AGENT=myapp.agents:support uvicorn fastapi_app:app
    agentpool worker            # in another shell, where myapp.agents imports

The agent (``EXAMPLE_AGENT``, an import path) is only named here: workers import it, the app never does.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel

from agentpool import ApprovalError, RunNotFound, aio

AGENT = os.environ.get("EXAMPLE_AGENT", "myapp.agents:support")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.redis = aio.connect()  # REDIS_URL
    yield
    await app.state.redis.aclose()
    await aio.aclose()  # what agentpool.aio made by itself (none here: the app passes its own client)


app = FastAPI(title="agentpool example", lifespan=lifespan)


class NewRun(BaseModel):
    task: str


class Decision(BaseModel):
    tool_use_id: str
    approved: bool
    reason: str = ""


@app.post("/runs")
async def start_run(body: NewRun) -> dict:
    try:
        # The app only names the agent (see above): workers load it, so it is not loaded here first.
        run_id = await aio.enqueue_run(AGENT, body.task, connection=app.state.redis, check_agent=False)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    return {"id": run_id}


@app.get("/runs/{run_id}")
async def show_run(run_id: str) -> dict:
    try:
        run = await aio.get_run(run_id, connection=app.state.redis, window=True)  # not its whole history
    except RunNotFound:
        raise HTTPException(404, f"no run {run_id}") from None
    return {
        "id": run.id,
        "status": run.status,
        "result": run.result,
        "error": run.error,
        "awaiting_approval": run.awaiting_approval,
    }


@app.post("/runs/{run_id}/approve")
async def decide(run_id: str, body: Decision) -> dict:
    try:
        decided = await aio.approve(
            run_id, body.tool_use_id, approved=body.approved, reason=body.reason or None, connection=app.state.redis
        )
    except RunNotFound:
        raise HTTPException(404, f"no run {run_id}") from None
    except ApprovalError as exc:  # the run no longer waits on that call: decided elsewhere, expired, cancelled
        raise HTTPException(409, str(exc)) from None
    return {"decided": decided}


@app.get("/runs/{run_id}/events")
async def events(run_id: str, after: Annotated[str | None, Query(pattern=r"^\d+-\d+$")] = None) -> StreamingResponse:
    """The run's events and the model's words as server-sent events, until the run ends or waits for a
    person. The page follows again after a decision, from the ``id`` of the last item it was given
    (``after``): what came since, and nothing it has shown already."""
    try:
        await aio.get_run(run_id, connection=app.state.redis, window=True)
    except RunNotFound:
        raise HTTPException(404, f"no run {run_id}") from None

    async def stream() -> AsyncIterator[str]:
        async for item in aio.watch(run_id, connection=app.state.redis, after=after):
            yield f"data: {json.dumps(item)}\n\n"
            if item["type"] == "status" and item.get("status") == "waiting_approval":
                break
        yield "event: end\ndata: {}\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>agentpool example</title><link rel="icon" href="data:,"></head>
<body>
<form id="start"><input id="task" size="60" placeholder="What should the agent do?"><button>Start</button></form>
<p>Run <code id="run"></code>: <b id="status">-</b></p>
<pre id="output"></pre>
<div id="approvals"></div>
<p id="result"></p>
<p id="error"></p>
<script>
const $ = (id) => document.getElementById(id);
let runId = null;
let lastId = null;  // the id of the last item shown: the page follows again from there
$("start").onsubmit = async (e) => {
  e.preventDefault();
  const res = await fetch("/runs", {method: "POST", headers: {"Content-Type": "application/json"},
                                    body: JSON.stringify({task: $("task").value})});
  runId = (await res.json()).id;
  lastId = null;
  $("run").textContent = runId;
  follow();
};
function follow() {
  const source = new EventSource(`/runs/${runId}/events` + (lastId ? `?after=${lastId}` : ""));
  source.onmessage = (msg) => {
    const item = JSON.parse(msg.data);
    if (item.id) lastId = item.id;
    if (item.type === "text_delta") $("output").textContent += item.text;
    if (item.type === "status") $("status").textContent = item.status;
  };
  source.addEventListener("end", () => { source.close(); refresh(); });
  return new Promise((resolve) => source.addEventListener("open", () => resolve(source), {once: true}));
}
// After a stream's end or a decision: show the run and the calls it waits on; follow it again if it goes on.
async function refresh() {
  const res = await fetch(`/runs/${runId}`);
  if (!res.ok) { $("error").textContent = (await res.json()).detail; return; }
  const run = await res.json();
  $("status").textContent = run.status;
  $("approvals").replaceChildren(...run.awaiting_approval.map((call) => {
    const row = document.createElement("div");
    row.className = "approval";
    row.textContent = `${call.name} ${JSON.stringify(call.input)} `;
    for (const [label, approved] of [["Approve", true], ["Deny", false]]) {
      const button = document.createElement("button");
      button.textContent = label;
      button.onclick = async () => {
        $("approvals").replaceChildren();  // one decision at a time
        // The run's last awaited call: the page follows before it decides, so that the worker streams the
        // next call's words from the first (a watcher that comes once a call has begun gets its words
        // only from when the worker notices it: a short call can be over by then).
        const last = run.awaiting_approval.length === 1;
        const source = last ? await follow() : null;
        const res = await fetch(`/runs/${runId}/approve`, {method: "POST", headers: {"Content-Type": "application/json"},
                                                           body: JSON.stringify({tool_use_id: call.id, approved})});
        $("error").textContent = res.ok ? "" : `Not decided: ${(await res.json()).detail}`;
        if (!res.ok || !last) {  // it waits on its other calls, or they were decided elsewhere
          if (source) source.close();
          await refresh();
        }
      };
      row.append(button);
    }
    return row;
  }));
  if (run.result) $("result").textContent = run.result;
  if (run.error) $("result").textContent = "Error: " + run.error;
  if (!["waiting_approval", "completed", "failed", "cancelled", "stopped"].includes(run.status)) follow();
}
</script>
</body></html>
"""


@app.get("/", response_class=HTMLResponse)
async def index() -> str:
    return PAGE
