"""Watching a run live: `agentpool.watch()` and `agentpool watch` show the model's words while its call
streams (thinking and tool input too), catch a late watcher up, end with the run, and cost nothing
when nobody watches."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agentpool import approve, enqueue_run, wait_for_run, watch
from agentpool.store import crypto, events
from agentpool.store.crypto import Cipher, generate_key
from agentpool.store.hints import pool_key
from agentpool.store.keys import RunKeys

from conftest import ROOT, script_task

ANSWER = "The release ships on Friday; Ana owns the changelog and the team has been told."
SLOW = {"chunk": 4, "interval": 0.03}
STEPS = [
    {
        "thinking": "First the notes.",
        "text": "Reading the notes.",
        "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}],
        "stream": SLOW,
    },
    {"text": ANSWER, "stream": SLOW},
]


def collect(run_id: str, r, **kw) -> list[dict]:
    items = []
    for item in watch(run_id, connection=r, **kw):
        item["seen"] = time.monotonic()
        items.append(item)
    return items


def text_of(items: list[dict], kind: str = "text_delta", turn: int | None = None) -> str:
    return "".join(i["text"] for i in items if i["type"] == kind and (turn is None or i["turn"] == turn))


def test_the_python_iterator_gives_events_and_the_words_as_they_stream_until_the_run_ends(r, pool, model):
    model.set_scripts({"live": STEPS})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("live"), connection=r)
    items = collect(run_id, r)  # returns once the run has ended

    assert items[-1]["type"] == "status" and items[-1]["status"] == "completed"
    assert text_of(items, turn=1) == ANSWER and text_of(items, "thinking_delta") == "First the notes."
    tool_input = [i for i in items if i["type"] == "input_json_delta"]
    assert tool_input and {i["name"] for i in tool_input} == {"read_notes"}
    assert '"topic": "release"' in "".join(i["text"] for i in tool_input)
    kinds = [i["type"] for i in items]
    assert {"turn_started", "model_responded", "tool_started", "tool_finished", "turn_committed"} <= set(kinds)
    # Live: the last turn's words came before its reply was saved, and many pieces of it, not one.
    answer = [i for i in items if i["type"] == "text_delta" and i["turn"] == 1]
    responded = next(i for i in items if i["type"] == "model_responded" and i["turn"] == "1")
    assert len(answer) >= 5, "streamed in many pieces, not one"
    assert answer[0]["seen"] < responded["seen"]
    assert wait_for_run(run_id, connection=r).status == "completed"


def test_a_late_watcher_catches_up_on_the_call_so_far(r, pool, model):
    model.set_scripts({"live": [{"text": ANSWER, "stream": {"chunk": 2, "interval": 0.05}}]})
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("live"), connection=r)
    deadline = time.monotonic() + 30
    while len(model.delta_times()) < 10:  # the call is well under way, unwatched
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.01)
    assert not r.exists(RunKeys.of(run_id).live), "nothing is written while nobody watches"
    items = collect(run_id, r)
    assert text_of(items) == ANSWER, "the text so far, then the rest"
    assert [i["purpose"] for i in items if i["type"] == "call_start"] == ["reply"]


def test_nobody_watching_costs_no_write(r, pool, model):
    model.set_scripts({"live": STEPS})
    pool.start(1)
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("live"), connection=r), connection=r)
    assert run.status == "completed"
    assert not r.exists(RunKeys.of(run.id).live) and not r.exists(RunKeys.of(run.id).watchers)


def test_events_only_and_since_now(r, pool, model):
    model.set_scripts({"live": STEPS})
    pool.start(1)
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("live"), connection=r), connection=r)
    items = collect(run.id, r, live_output=False)
    assert not any(i["type"].endswith("_delta") for i in items) and items[-1]["status"] == "completed"
    assert collect(run.id, r, since_start=False) == [], "an ended run has nothing new"


def test_a_watcher_goes_on_after_the_last_item_it_was_given(r, pool, model):
    """What a page does after a person's decision: it follows the run again from its last item's id,
    and is given neither the earlier call's words again (the live stream keeps them) nor less."""
    model.set_scripts(
        {
            "deploy": [
                {"text": "Deploying once you approve.", "tool_calls": [{"name": "deploy", "input": {"version": "2"}}]},
                {"text": "Deployed.", "stream": SLOW},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:guarded", script_task("deploy"), connection=r)
    first = []
    for item in watch(run_id, connection=r):
        first.append(item)
        if item["type"] == "status" and item["status"] == "waiting_approval":
            break
    assert r.exists(RunKeys.of(run_id).live), "the first call's words are still in the live stream"
    approve(run_id, connection=r)
    rest = collect(run_id, r, after=first[-1]["id"])

    assert text_of(first) == "Deploying once you approve." and text_of(rest) == "Deployed."
    seen = [i["id"] for i in first + rest if "id" in i]
    events = [i["id"] for i in collect(run_id, r, live_output=False) if "id" in i]
    assert len(seen) == len(set(seen)) and set(events) <= set(seen), "nothing twice, nothing missed"
    assert rest[-1]["status"] == "completed"
    with pytest.raises(ValueError, match="after must be the id of an item watch gave"):
        next(watch(run_id, connection=r, after="$"))


def test_a_short_call_no_worker_published_reaches_a_watcher_from_the_saved_reply(r, pool, model):
    """A worker that found nobody watching skips its next look for a second (a turn then costs Redis no
    command for it), and a call looks again only about once a second: a short call begun just after a
    watcher came is never published live. The watcher gets its words all the same, once, from the saved
    reply, before that reply's model_responded; the words it was given live are not given again."""
    model.set_scripts(
        {
            "quick": [
                {"text": "Reading.", "tool_calls": [{"name": "slow_read", "input": {"seconds": 0.3}}]},
                {"text": ANSWER},
            ]
        }
    )
    pool.start(1)
    run_id = enqueue_run("pool_agents:support", script_task("quick"), connection=r)
    deadline = time.monotonic() + 60
    while not any(e["kind"] == "tool_started" for _, e in events.read(r, run_id)):
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.01)
    items = collect(run_id, r, since_start=False)  # came during the tool: turn 1's call is all it can get

    assert text_of(items) == ANSWER, [i for i in items if i["type"] not in ("turn_started", "tool_finished")]
    kinds = [i["type"] for i in items if i.get("turn") in (1, "1")]
    assert kinds.index("call_end") < kinds.index("model_responded"), kinds
    if "saved" in [i.get("outcome") for i in items]:  # the case this test is about (not a slow machine's)
        (responded,) = [i for i in items if i["type"] == "model_responded"]
        assert {i["id"] for i in items if i.get("call") == "saved:1"} == {responded["id"]}
        again = collect(run_id, r)
        assert again[-1]["status"] == "completed" and text_of(again) == "", "a replay is the events, as before"


def test_the_cli_prints_the_words_as_they_arrive(r, pool, model):
    model.set_scripts({"live": STEPS})
    run_id = enqueue_run("pool_agents:support", script_task("live"), connection=r)
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(
        [sys.executable, "-m", "agentpool", "watch", run_id],
        env={**os.environ, "REDIS_URL": pool.env["REDIS_URL"]},
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as watcher:
        assert watcher.stdout is not None and watcher.stderr is not None
        # The watcher is there before any worker: what it prints live is not a late catch-up.
        lines.append((time.monotonic(), watcher.stdout.readline().rstrip("\n")))
        pool.start(1)
        for line in watcher.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
        assert watcher.wait(timeout=60) == 0, watcher.stderr.read()

    out = "\n".join(text for _, text in lines)
    assert "(thinking) First the notes." in out and "-> read_notes" in out
    answer = next(i for i, (_, text) in enumerate(lines) if text.endswith(ANSWER))
    responded = [i for i, (_, text) in enumerate(lines) if " model_responded " in text]
    assert responded[-1] > answer, "the words were printed before the reply was saved"
    assert lines[-1][1].startswith(f"run {run_id} completed after 2 turns")


def test_live_output_is_sealed_at_rest_when_encryption_is_on(r, pool, model):
    key = generate_key()
    model.set_scripts({"secret": [{"text": "The Bluebird offer is 41 per share.", "stream": SLOW}]})
    pool.start(1, AGENTPOOL_ENCRYPTION_KEY=key)
    crypto.configure(Cipher([key]))
    try:
        run_id = enqueue_run("pool_agents:support", script_task("secret"), connection=r)
        raw: list[bytes] = []
        items = []
        for item in watch(run_id, connection=r):
            items.append(item)
            raw += [b"".join(k + v for k, v in f.items()) for _, f in r.xrange(RunKeys.of(run_id).live)]
        assert text_of(items) == "The Bluebird offer is 41 per share."
        assert raw and not any(b"Bluebird" in entry or b"41 per" in entry for entry in raw)
    finally:
        crypto.configure(None)


def test_the_watch_look_survives_a_script_cache_miss_while_another_turn_learns_nobody_watches(r):
    """The lease's round trip carries the look at the watchers; a script cache miss (a Redis restarted,
    a new one) sends the round trip again and stages its reads anew. If another turn of the process
    learned meanwhile that nobody watches, the retry stages no look, and the turn must not read a reply
    that is not there (it used to fail with an IndexError, its job failed, its run taken over)."""
    from agentpool.store import live
    from agentpool.store.lease import Acquire, acquire

    run_id = enqueue_run("pool_agents:support", "a task", connection=r)
    keys = RunKeys.of(run_id)
    r.script_flush()  # the first attempt misses the cache
    lookup = live.WatchLookup(r)
    attempts = []

    def then(pipe) -> None:
        lookup.stage(pipe, keys)
        attempts.append(len(pipe.command_stack))
        # Between the two attempts, another turn of this process finds no run watched.
        live.nobody_watched.adopt({pool_key(r): time.monotonic() + 60})

    try:
        got = acquire(r, keys, turn=0, worker_id="w.1", ttl_ms=10_000, then=then)
    finally:
        live.nobody_watched.clear()
    assert got.code is Acquire.ACQUIRED, got
    assert len(attempts) == 2 and attempts[0] > attempts[1], "sent twice, the look staged only the first time"
    assert lookup.watched(got.then) is False
