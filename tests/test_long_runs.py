"""Runs past the model's context window, in real workers against a scripted model with a small window:
agentpool's own compaction (a summary call) and the API's (the compact_20260112 edit), the run stopped
with compaction off and resumed once it is on, and workers SIGKILLed at every window of a compaction."""

from __future__ import annotations

import base64
import json
import random
import struct
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from agentpool import enqueue_run, get_run, resume, wait_for_run
from agentpool.agent import SUMMARY_PREAMBLE
from agentpool.store.errors import UnreadableRecord
from agentpool.store.events import read as read_events
from agentpool.store.keys import RunKeys
from agentpool.store.stats import SPEND_EVENTS
from agentpool.store.window import is_compaction_point
from agentpool.testing.localpool import RedisServer
from agentpool.testing.scripted_model import ScriptedModel

from conftest import Pool, assert_valid_conversation, script_task, wait_for_status

USAGE = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def pages(n: int, size: int = 4000, final: str = "All pages read.") -> list[dict]:
    return [{"tool_calls": [{"name": "read_page", "input": {"page": i, "size": size}}]} for i in range(n)] + [
        {"text": final}
    ]


@pytest.fixture(scope="module")
def small_model() -> Iterator[ScriptedModel]:
    """A model whose context window holds about 3 pages of 4 KB, and 70k tokens for the API's compaction."""
    server = ScriptedModel(cache_min_tokens=64, context_window=12_000).start()
    yield server
    server.stop()


@pytest.fixture
def small(small_model: ScriptedModel) -> ScriptedModel:
    small_model.reset()
    small_model.set_scripts({})
    return small_model


@pytest.fixture
def long_pool(r: Redis, redis_server: RedisServer, small: ScriptedModel, tmp_path: Path) -> Iterator[Pool]:
    p = Pool(redis_server.url, small, tmp_path)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def wide_model() -> Iterator[ScriptedModel]:
    server = ScriptedModel(cache_min_tokens=64, context_window=70_000).start()
    yield server
    server.stop()


@pytest.fixture
def wide_pool(r: Redis, redis_server: RedisServer, wide_model: ScriptedModel, tmp_path: Path) -> Iterator[Pool]:
    wide_model.reset()
    wide_model.set_scripts({})
    p = Pool(redis_server.url, wide_model, tmp_path)
    yield p
    p.stop()


def events(r: Redis, run_id: str, kind: str) -> list[dict[str, str]]:
    return [e for _, e in read_events(r, run_id) if e["kind"] == kind]


def spent_by_events(r: Redis, run_id: str) -> dict[str, int]:
    total: Counter = Counter()
    for _id, event in read_events(r, run_id):
        if event["kind"] in SPEND_EVENTS:
            for name in USAGE:
                total[name] += int(event.get(name, 0))
    return {name: total[name] for name in USAGE}


def summaries(messages: list[dict]) -> list[int]:
    return [
        i
        for i, m in enumerate(messages)
        if m["role"] == "user"
        and isinstance(m["content"], list)
        and m["content"][0].get("text", "").startswith(SUMMARY_PREAMBLE)
    ]


def test_a_summary_carries_a_run_past_the_context_window(r, long_pool, small):
    small.set_scripts({"pages": pages(18)})
    long_pool.start(1)
    run_id = enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r)
    run = wait_for_run(run_id, timeout=120, connection=r)

    assert run.status == "completed", (run.error, long_pool.logs())
    assert run.result == "All pages read." and run.turns == 19
    assert small.stats()["rejected"] == 0, small.stats()["rejections"]
    compacted = events(r, run_id, "compacted")
    at = summaries(run.messages)
    assert len(compacted) == len(at) >= 3 and small.stats()["summaries"] == len(at)
    assert [int(e["window_start"]) for e in compacted] == at, "each summary is where its event says"
    assert {e["mode"] for e in compacted} == {"summary"} and {e["why"] for e in compacted} == {"trigger"}
    # The whole conversation is kept; the next request would send only what follows the last summary.
    assert len(run.messages) == 1 + 2 * 19 - 1 + len(at) and run.window_start == at[-1]
    assert run.window == run.messages[at[-1] :]
    windowed = get_run(run_id, connection=r, window=True)
    assert windowed.messages == run.window and windowed.messages_from == windowed.window_start == at[-1]
    assert int(r.hget(RunKeys.of(run_id).run, "window")) == at[-1]
    # No request held more than the window, and usage counts every call, summaries included.
    assert max(small.stats()["request_bytes"]) < 12_000 * 4
    assert run.usage == spent_by_events(r, run_id)
    assert [e["page"] for e in long_pool.effects()] == list(range(18)), "each page read once"
    assert_valid_conversation(run.messages)


def test_a_summary_cut_at_summary_max_tokens_is_saved_with_a_note_that_it_is_cut(r, long_pool, small):
    # The scripted model ends a summary at the request's max_tokens, as the API does: the agent's
    # summary_max_tokens is 1,000 (4,000 characters), and this summary would run to 7,000.
    steps = [{**step, "summary": {"text": "detail " * 1_000}} for step in pages(8)]
    small.set_scripts({"pages": steps})
    long_pool.start(1)
    run_id = enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r)
    run = wait_for_run(run_id, timeout=120, connection=r)

    assert run.status == "completed", (run.error, long_pool.logs())
    compacted = events(r, run_id, "compacted")
    assert compacted and all(e.get("cut") == "max_tokens" for e in compacted), compacted
    for at in summaries(run.messages):
        text = run.messages[at]["content"][0]["text"]
        assert text.endswith("point is missing. Check the state of the task before relying on it.]"), text[-200:]
        assert "cut at its length limit (1000 tokens)" in text
    assert "the summary ended at summary_max_tokens=1000" in long_pool.logs(50_000)
    assert run.usage == spent_by_events(r, run_id), "the cut summary is counted like any call"


def test_loading_a_turn_reads_only_from_the_latest_compaction_point(r, long_pool, small):
    # Proof by damage: a message before the window is made unreadable; the run goes on, as its turns
    # never read it, while reading the whole conversation fails.
    steps = pages(10)
    steps[7] = {**steps[7], "delay": 1.5}  # time to do the damage
    small.set_scripts({"pages": steps})
    long_pool.start(1)
    run_id = enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r)
    keys = RunKeys.of(run_id)
    deadline = time.monotonic() + 60
    while int(r.hget(keys.run, "turns") or 0) < 7 or int(r.hget(keys.run, "window") or 0) < 2:
        assert time.monotonic() < deadline, long_pool.logs()
        time.sleep(0.05)
    r.lset(keys.messages, 1, b"\xc1 not msgpack")
    wait_for_status(r, run_id, "completed", timeout=60)
    assert get_run(run_id, connection=r, window=True).messages[-1]["content"][0]["text"] == "All pages read."
    with pytest.raises(UnreadableRecord, match="message 1"):
        get_run(run_id, connection=r)


def test_the_api_compaction_carries_a_run_past_the_context_window(r, wide_pool, wide_model):
    wide_model.set_scripts({"pages": pages(26, size=16_000)})
    wide_pool.start(1)
    run_id = enqueue_run("long_agents:compacting", script_task("pages", "Read the archive"), connection=r)
    run = wait_for_run(run_id, timeout=120, connection=r)

    assert run.status == "completed", (run.error, wide_pool.logs())
    assert wide_model.stats()["rejected"] == 0, wide_model.stats()["rejections"]
    points = [i for i, m in enumerate(run.messages) if is_compaction_point(m)]
    assert len(points) >= 2 and wide_model.stats()["compactions"] == len(points)
    assert run.window_start == points[-1] and run.window[0]["content"][0]["type"] == "compaction"
    compacted = [e for e in events(r, run_id, "model_responded") if e.get("compacted")]
    assert len(compacted) == len(points) and {e["compacted"] for e in compacted} == {"server"}
    assert run.usage == spent_by_events(r, run_id), "the compaction's own tokens (usage.iterations) count"
    assert max(wide_model.stats()["request_bytes"]) < 70_000 * 4
    assert_valid_conversation(run.messages)


def test_a_summary_of_a_window_the_api_compacted_sends_its_block_back(r, wide_pool, wide_model):
    # The API compacts at turn 12; later a reply runs into the window, so the next turn asks for a
    # summary of a window that starts with the API's compaction block (which needs its beta).
    steps = [*pages(13, size=16_000)[:-1], {"text": "word " * 60_000}, {"text": "Done after the summary."}]
    wide_model.set_scripts({"pages": steps})
    wide_pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:compacting", script_task("pages", "Read the archive"), connection=r),
        timeout=120,
        connection=r,
    )
    assert run.status == "completed", (run.error, wide_pool.logs())
    assert wide_model.stats()["compactions"] == 1 and wide_model.stats()["summaries"] == 1
    assert [e["why"] for e in events(r, run.id, "compacted")] == ["overflow"]
    assert run.result == "Done after the summary."
    assert_valid_conversation(run.messages)


def test_pause_after_compaction_continues_from_the_block(r, wide_pool, wide_model):
    wide_model.set_scripts({"pages": pages(16, size=16_000)})
    wide_pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:pausing", script_task("pages", "Read the archive"), connection=r),
        timeout=120,
        connection=r,
    )
    assert run.status == "completed", (run.error, wide_pool.logs())
    alone = [i for i, m in enumerate(run.messages) if is_compaction_point(m) and len(m["content"]) == 1]
    assert alone and all(run.messages[i + 1]["role"] == "assistant" for i in alone), "the next turn went on from it"
    assert [e["page"] for e in wide_pool.effects()] == list(range(16))
    assert wide_model.stats()["rejected"] == 0, wide_model.stats()["rejections"]


def test_tool_result_clearing_is_passed_through_to_the_api(r, wide_pool, wide_model):
    wide_model.set_scripts({"pages": pages(8, size=16_000)})
    wide_pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:clearing", script_task("pages", "Read the archive"), connection=r),
        timeout=120,
        connection=r,
    )
    assert run.status == "completed", (run.error, wide_pool.logs())
    assert wide_model.stats()["rejected"] == 0, wide_model.stats()["rejections"]
    prompts = [
        sum(int(e.get(k, 0)) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
        for e in events(r, run.id, "model_responded")
    ]
    # 8 pages of ~4,000 tokens: with old results cleared, the model reads about two of them at most.
    assert max(prompts) < 12_000 and len(run.messages) == 1 + 2 * 9 - 1, prompts


def test_with_compaction_off_a_full_window_stops_the_run_and_compaction_then_resumes_it(r, long_pool, small):
    small.set_scripts({"pages": pages(14)})
    first = long_pool.start(1)[0]
    run_id = enqueue_run("long_agents:switchable", script_task("pages", "Read the archive"), connection=r)
    stopped = wait_for_run(run_id, timeout=120, connection=r)
    assert stopped.status == "stopped", (stopped.error, long_pool.logs())
    assert "context window" in stopped.error and "Agent(compaction=True)" in stopped.error
    long_pool.kill(first)
    long_pool.start(1, LONG_RUNS_COMPACTION="1")  # the agent, redeployed with compaction on
    resume(run_id, connection=r)
    run = wait_for_run(run_id, timeout=120, connection=r)
    assert run.status == "completed", (run.error, long_pool.logs())
    assert events(r, run_id, "compacted") and run.messages[: len(stopped.messages)] == stopped.messages
    assert [e["page"] for e in long_pool.effects()] == list(range(14))
    assert_valid_conversation(run.messages)


def test_a_reply_cut_by_the_window_is_kept_and_the_next_request_compacts_first(r, long_pool, small):
    small.set_scripts({"essay": [*pages(2)[:-1], {"text": "word " * 8_000}, {"text": "In short: done."}]})
    long_pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:summarizing", script_task("essay", "Write it up"), connection=r),
        timeout=120,
        connection=r,
    )
    assert run.status == "completed", (run.error, long_pool.logs())
    overflowed = [
        e for e in events(r, run.id, "model_responded") if e["stop_reason"] == "model_context_window_exceeded"
    ]
    assert len(overflowed) == 1
    assert [e["why"] for e in events(r, run.id, "compacted")][-1] == "overflow"
    assert run.result == "In short: done."


def test_a_result_larger_than_the_window_is_summarized_with_long_results_cut(r, long_pool, small):
    huge = [{"tool_calls": [{"name": "read_page", "input": {"page": 0, "size": 60_000}}]}, {"text": "Got the gist."}]
    small.set_scripts({"huge": huge})
    long_pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:summarizing", script_task("huge", "Read it"), connection=r), timeout=120, connection=r
    )
    assert run.status == "completed", (run.error, long_pool.logs())
    assert [e["why"] for e in events(r, run.id, "compacted")] == ["trigger"]
    # The summary request of the whole window was refused as too long; it went again with the result cut.
    assert [x for x in small.stats()["rejections"] if "prompt is too long" in x] and small.stats()["summaries"] == 1


def test_a_request_the_api_refuses_as_too_long_is_compacted_then_sent_again(r, long_pool, small):
    # The API's compaction triggers at 50,000 tokens at the lowest; this model's window is 12,000: its
    # requests are refused as too long first, and agentpool compacts them with a summary.
    small.set_scripts({"pages": pages(20)})
    long_pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:compacting", script_task("pages", "Read it"), connection=r), timeout=120, connection=r
    )
    assert run.status == "completed", (run.error, long_pool.logs())
    compacted = events(r, run.id, "compacted")
    assert compacted and {(e["mode"], e["why"]) for e in compacted} == {("summary", "too_long")}
    assert [e["page"] for e in long_pool.effects()] == list(range(20))
    assert_valid_conversation(run.messages)


@pytest.mark.crash
@pytest.mark.parametrize("point", ["before_compaction", "mid_stream", "after_summary_reply", "after_compaction_save"])
def test_a_worker_killed_at_every_window_of_a_compaction(point, r, long_pool, small):
    small.set_scripts({"pages": pages(14)})
    long_pool.start(2, AGENTPOOL_FAULTS=point)
    run_id = enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r)
    run = wait_for_run(run_id, timeout=180, connection=r)

    assert run.status == "completed", (run.error, long_pool.logs())
    assert run.turns == 15 and small.stats()["rejected"] == 0, small.stats()["rejections"]
    kills = len(list(long_pool.tmp.glob(f"fault-{point}-{run_id}-*")))
    assert kills >= 2, f"{point} fired {kills} times"
    at = summaries(run.messages)
    compacted = events(r, run_id, "compacted")
    # Old window or new, never a mix: one summary per compaction event, each where its event says.
    assert [int(e["window_start"]) for e in compacted] == at
    asked = small.stats()["summaries"]
    if point == "after_compaction_save":
        assert asked == len(at), "a saved summary is never asked for (nor paid) again"
    if point == "after_summary_reply":
        assert asked == len(at) + kills, "a summary lost before its save is asked for again"
    assert run.usage == spent_by_events(r, run_id)
    assert [e["page"] for e in long_pool.effects()] == list(range(14)), "no tool ran twice"
    assert_valid_conversation(run.messages)


@pytest.mark.crash
@pytest.mark.parametrize("point", ["after_model_reply", "after_save_a"])
def test_a_worker_killed_around_the_save_of_an_api_compaction(point, r, wide_pool, wide_model):
    wide_model.set_scripts({"pages": pages(14, size=16_000)})
    wide_pool.start(2, AGENTPOOL_FAULTS=point)
    run_id = enqueue_run("long_agents:compacting", script_task("pages", "Read the archive"), connection=r)
    run = wait_for_run(run_id, timeout=180, connection=r)

    assert run.status == "completed", (run.error, wide_pool.logs())
    # Killed between save points A and B, the window's hint lags one turn: the load trims at the block.
    assert wide_model.stats()["rejected"] == 0, wide_model.stats()["rejections"]
    points = [i for i, m in enumerate(run.messages) if is_compaction_point(m)]
    assert points and run.window_start == points[-1]
    assert run.usage == spent_by_events(r, run_id)
    assert json.dumps(run.messages)
    assert_valid_conversation(run.messages)


def test_a_fork_of_a_summarized_run_starts_from_the_summary_its_copy_holds(r, long_pool, small):
    from agentpool import fork_run

    small.set_scripts({"pages": pages(12)})
    long_pool.start(1)
    parent = enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r)
    done = wait_for_run(parent, timeout=120, connection=r)
    assert done.status == "completed", (done.error, long_pool.logs())
    at = summaries(done.messages)
    replies = [i for i, m in enumerate(done.messages) if m["role"] == "assistant"]
    assert at and at[0] < replies[8]

    fork_id = fork_run(parent, at_turn=8, connection=r)
    fork = get_run(fork_id, connection=r)
    end = replies[8] - (1 if replies[8] - 1 in at else 0)  # a summary opening turn 9 is not copied
    assert fork.messages == done.messages[:end] and fork.turns == 8
    assert fork.window_start == max(i for i in at if i < end)  # the window the copy's next request sends
    finished = wait_for_run(fork_id, timeout=120, connection=r)
    assert finished.status == "completed" and finished.result == "All pages read." and finished.turns == 13
    assert small.stats()["rejected"] == 0, small.stats()["rejections"]
    assert [e["page"] for e in long_pool.effects() if e["run"] == fork_id] == list(range(8, 12))
    assert [e["page"] for e in long_pool.effects() if e["run"] == parent] == list(range(12))
    assert_valid_conversation(finished.messages)


def test_a_chat_the_api_compacted_loads_its_turns_from_the_compaction_point(r, wide_pool, wide_model):
    # A conversation with no tool call: every reply ends the run at save point A (there is no save point
    # B to move the header's window). Once the API compacts it, later turns must still read only from
    # the compaction point on: proof by damage, as above.
    from agentpool import send_message

    wide_model.set_scripts({"chat": [{"text": f"Noted, part {i}."} for i in range(8)]})
    wide_pool.start(1)
    notes = "the meeting decided item {} ships on time. "
    run_id = enqueue_run(
        "long_agents:compacting", script_task("chat", "Keep these notes. " + notes.format(0) * 1_400), connection=r
    )
    keys = RunKeys.of(run_id)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
    for part in range(1, 8):
        sent = send_message(run_id, notes.format(part) * 1_400, connection=r)
        run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)
        assert run.status == "completed", (run.error, wide_pool.logs())
        if any(is_compaction_point(m) for m in run.messages):
            break
    points = [i for i, m in enumerate(run.messages) if is_compaction_point(m)]
    assert points, "the API compacted the chat"
    assert int(r.hget(keys.run, "window")) == points[-1] == run.window_start, "the window moved at save point A"
    r.lset(keys.messages, 1, b"\xc1 not msgpack")
    for part in range(2):
        send_message(run_id, f"And part {part} of the follow-up?", connection=r)  # the run is running again
        wait_for_status(r, run_id, "completed", timeout=60)  # (wait_for_run reads the whole conversation)
        windowed = get_run(run_id, connection=r, window=True)
    assert windowed.turns == run.turns + 2 and windowed.result == f"Noted, part {windowed.turns - 1}."
    assert windowed.window_start == points[-1]
    assert wide_model.stats()["rejected"] == 0, wide_model.stats()["rejections"]


def test_a_message_longer_than_the_window_is_summarized_cut_like_a_long_tool_result(r, long_pool, small):
    # A follow-up message sent as a plain string (kept so): once it alone passes the context window, the
    # summary request is refused as too long and goes again with long texts cut, as for a tool result.
    from agentpool import send_message

    small.set_scripts({"chat": [{"text": "Ready."}, {"text": "Got the gist of it."}]})
    long_pool.start(1)
    run_id = enqueue_run("long_agents:summarizing", script_task("chat", "Read what I send"), connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
    sent = send_message(run_id, "the archive says every item shipped on time. " * 1_400, connection=r)
    run = wait_for_run(run_id, timeout=120, connection=r, after_message=sent)

    assert run.status == "completed", (run.error, long_pool.logs())
    assert run.result == "Got the gist of it."
    assert [e["why"] for e in events(r, run_id, "compacted")] == ["trigger"]
    assert [x for x in small.stats()["rejections"] if "prompt is too long" in x] and small.stats()["summaries"] == 1
    assert_valid_conversation(run.messages)


def test_a_summary_made_from_a_cut_window_keeps_the_summary_it_starts_from_whole(r, long_pool, small):
    # The first summaries end with a line to remember, past the first 2,000 characters. A later page is
    # larger than the window: that summary request is refused as too long and goes again with long
    # texts cut, but never the summary the window starts from (what the run knows of its past).
    remember = "Remember: the vault code is 4711."
    long_summary = {"summary": {"text": "detail " * 400 + "\n" + remember}}
    steps = [{**step, **long_summary} for step in pages(7)[:-1]]
    steps += [{"tool_calls": [{"name": "read_page", "input": {"page": 7, "size": 60_000}}]}, {"text": "Done."}]
    small.set_scripts({"pages": steps})
    long_pool.start(1)
    run = wait_for_run(
        enqueue_run("long_agents:summarizing", script_task("pages", "Read the archive"), connection=r),
        timeout=120,
        connection=r,
    )
    assert run.status == "completed", (run.error, long_pool.logs())
    at = summaries(run.messages)
    assert len(at) >= 2 and at[-1] == run.window_start
    assert [x for x in small.stats()["rejections"] if "prompt is too long" in x], "the last summary was cut"
    before = run.messages[at[-2]]["content"][0]["text"]
    assert before.index(remember) > 2_000, "the line to remember is past what a cut keeps"
    assert remember in run.messages[at[-1]]["content"][0]["text"], run.messages[at[-1]]["content"][0]["text"]
    assert_valid_conversation(run.messages)


def png(width: int, height: int) -> str:
    """A PNG of noise (its data does not compress: about 3 bytes a pixel), base64."""
    noise = random.Random(width * height)
    rows = b"".join(b"\x00" + noise.randbytes(3 * width) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    image = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return base64.b64encode(image).decode()


def pdf(pages: int, *, packed: bool = False, noise: int = 0) -> str:
    """A PDF of ``pages`` pages of text, base64: its page objects written plainly, or ``packed`` into a
    compressed object stream (as PDF 1.5 writers do), with ``noise`` bytes of an image that does not
    compress on its first page."""
    first = 3 + pages  # the object after the pages: the first page's contents
    page_objects = [
        f"{3 + n} 0 obj\n<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {first} 0 R >>\nendobj\n"
        for n in range(pages)
    ]
    kids = " ".join(f"{3 + n} 0 R" for n in range(pages))
    text = b"BT /F1 12 Tf 72 720 Td (" + b"The quarterly figures, page after page. " * 20 + b") Tj ET"
    body = [
        b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n",
        b"1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n",
        f"2 0 obj\n<< /Type /Pages /Kids [{kids}] /Count {pages} >>\nendobj\n".encode(),
    ]
    if packed:
        packed_pages = zlib.compress("".join(page_objects).encode())
        header = f"<< /Type /ObjStm /N {pages} /First 0 /Filter /FlateDecode /Length {len(packed_pages)} >>"
        body.append(f"{first + 2} 0 obj\n{header}\nstream\n".encode() + packed_pages + b"\nendstream\nendobj\n")
    else:
        body.extend(obj.encode() for obj in page_objects)
    body.append(f"{first} 0 obj\n<< /Length {len(text)} >>\nstream\n".encode() + text + b"\nendstream\nendobj\n")
    image = random.Random(noise).randbytes(noise)
    body.append(f"{first + 1} 0 obj\n<< /Type /XObject /Subtype /Image /Length {noise} >>\nstream\n".encode())
    body.append(image + b"\nendstream\nendobj\ntrailer\n<< /Root 1 0 R >>\n%%EOF\n")
    return base64.b64encode(b"".join(body)).decode()


def pdf_block(pages: int, **kwargs: Any) -> dict[str, Any]:
    return {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": pdf(pages, **kwargs)},
    }


@pytest.mark.parametrize("media", ["image", "pdf"])
def test_an_image_or_a_pdf_counts_toward_the_trigger_as_the_model_counts_it_not_by_its_base64(
    r, long_pool, small, media
):
    # 90 KB of base64 for an image of 150 x 150 pixels (30 tokens to the model), or for a PDF of one page
    # (2,400): read as text it would be 30,000 tokens, past the trigger (6,000), and the run would compact
    # it away before the model ever answered the message that brought it.
    from agentpool import send_message

    small.set_scripts({"chat": [{"text": "Ready."}, {"text": "Seen."}]})
    long_pool.start(1)
    run_id = enqueue_run("long_agents:summarizing", script_task("chat", "Describe what I send"), connection=r)
    assert wait_for_run(run_id, timeout=60, connection=r).status == "completed"
    if media == "image":
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png(150, 150)}}
    else:
        block = pdf_block(1, packed=True, noise=65_000)
    assert len(block["source"]["data"]) > 80_000
    sent = send_message(run_id, [block, {"type": "text", "text": "What is this?"}], connection=r)
    run = wait_for_run(run_id, timeout=60, connection=r, after_message=sent)

    assert run.status == "completed" and run.result == "Seen.", (run.error, long_pool.logs())
    assert not events(r, run_id, "compacted") and small.stats()["summaries"] == 0
    assert run.window_start == 0 and run.window[-2]["content"][0] == block, f"the model was sent the {media}"
    assert small.stats()["rejected"] == 0, small.stats()["rejections"]


def test_a_reply_whose_kept_context_size_is_damaged_fails_its_run_at_once_saying_so(r, long_pool, small):
    """The turn after a reply computes with the context size kept beside it (the compaction trigger):
    a damaged one is an unreadable record, the run failed saying where, its data left as found, and the
    worker serves other runs; not a ValueError at every retry of the turn."""
    from agentpool import send_message
    from agentpool.store.codec import pack, unpack

    small.set_scripts({"chat": [{"text": "Ready."}, {"text": "Again."}]})
    long_pool.start(1)
    bad = enqueue_run("long_agents:summarizing", script_task("chat", "Talk to me"), connection=r)
    assert wait_for_run(bad, timeout=60, connection=r).status == "completed"
    keys = RunKeys.of(bad)
    record = unpack(r.lindex(keys.messages, 1), "reply")
    assert isinstance(record["meta"]["context_tokens"], int)
    record["meta"]["context_tokens"] = "lots"
    r.lset(keys.messages, 1, pack(record))
    damaged = r.lindex(keys.messages, 1)
    send_message(bad, "One more thing.", connection=r)
    good = enqueue_run("long_agents:summarizing", script_task("chat", "Talk to me too"), connection=r)

    assert wait_for_run(good, timeout=60, connection=r).status == "completed"
    failed = wait_for_run(bad, timeout=60, connection=r)
    assert failed.status == "failed" and "message 1 has a context_tokens that is not a count" in failed.error, (
        failed.status,
        failed.error,
        long_pool.logs(),
    )
    assert r.lindex(keys.messages, 1) == damaged, "the data is left as found"
