"""Tools that misbehave the ways real ones do, on real workers: text that cannot be encoded, huge error
texts, a hung verify hook, tools that spin past their timeout in a threaded worker. Nothing a tool
returns, raises or keeps doing may make a turn unrecordable, oversized or stuck, or leak for good."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from tool_agents import LONE_SURROGATE

from agentpool import enqueue_run, wait_for_run
from agentpool.store import crypto
from agentpool.store.crypto import Cipher, generate_key
from agentpool.store.events import read as read_events
from agentpool.testing.localpool import WorkerProcesses

from conftest import Pool, assert_valid_conversation, script_task


def start_threaded(pool: Pool, name: str, concurrency: int = 4, **env: str):
    args = ("--log-level", "INFO", "--concurrency", str(concurrency), "--name", name, "--no-scheduler")
    return WorkerProcesses.start(pool, 1, *args, **env)[0]


def worker_process(supervisor, timeout: float = 120) -> int:
    """The threaded worker process the supervisor runs now."""
    from agentpool.testing.localpool import children_of

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = children_of(supervisor.pid)
        if found:
            return found[0]
        assert supervisor.poll() is None, "the supervisor exited"
        time.sleep(0.02)
    raise AssertionError("the supervisor started no worker process")


def results_of(run) -> list[dict]:
    return [
        b
        for m in run.messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    ]


def test_lone_surrogates_from_tools_and_the_model_are_recorded_and_the_run_completes(r, pool, model):
    key = generate_key()
    crypto.configure(Cipher([key]))  # this process reads the run; the worker encrypts it at rest
    try:
        model.set_scripts(
            {
                "cut": [
                    {
                        "tool_calls": [
                            {"name": "fetch_title", "input": {"url": "https://news.example/a"}},
                            {"name": "parse_feed", "input": {"url": "https://news.example/feed"}},
                        ]
                    },
                    {"text": "The title arrived cut: Title " + LONE_SURROGATE},
                ]
            }
        )
        start_threaded(pool, "surrogates", AGENTPOOL_ENCRYPTION_KEY=key)
        run_id = enqueue_run("tool_agents:misbehaving", script_task("cut"), connection=r)
        run = wait_for_run(run_id, timeout=60, connection=r)

        assert run.status == "completed", (run.error, pool.logs())
        title, failure = results_of(run)
        assert title["content"] == "Title \ufffd" and not title.get("is_error"), title
        assert failure["is_error"] and "ValueError: bad entry \ufffd at byte 12" in failure["content"], failure
        assert run.result == "The title arrived cut: Title \ufffd", "the model's own text is recorded too"
        assert_valid_conversation(run.messages)
        ran = Counter(e["tool"] for e in pool.effects())
        assert (ran["fetch_title"], ran["parse_feed"]) == (1, 1), f"each tool ran once: {ran}"
        assert not [e for _, e in read_events(r, run_id) if e["kind"] == "takeover"], "no attempt was lost"
    finally:
        crypto.configure(None)


def test_an_exception_text_is_cut_to_max_result_chars_like_any_result(r, pool, model):
    model.set_scripts(
        {"huge": [{"tool_calls": [{"name": "dump_state", "input": {"item": "cache"}}]}, {"text": "Noted."}]}
    )
    pool.start(1)
    run = wait_for_run(
        enqueue_run("tool_agents:misbehaving", script_task("huge"), connection=r), timeout=60, connection=r
    )

    assert run.status == "completed", (run.error, pool.logs())
    (result,) = results_of(run)
    prefix = "dump_state failed: RuntimeError: state: "
    assert result["is_error"] and result["content"].startswith(prefix + "xxx")
    assert f"[... cut: the result was {len(prefix) + 1_000_000} characters, the limit is 1000]" in result["content"]
    assert len(result["content"]) < 1100, len(result["content"])
    stored = sum(len(blob) for blob in r.lrange(f"ap:{{run:{run.id}}}:messages", 0, -1))
    assert stored < 5000, f"{stored} bytes of messages stored"


@pytest.mark.crash
def test_a_hung_verify_hook_times_out_with_the_tool_and_means_cannot_tell(r, pool, model):
    # The work horse dies right after the wire went out; the worker taking over asks the verify hook,
    # which hangs (the bank's status API is down) for longer than the run is given to finish.
    model.set_scripts(
        {"wire": [{"tool_calls": [{"name": "wire_money", "input": {"amount_cents": 500}}]}, {"text": "Checked."}]}
    )
    pool.start(1, AGENTPOOL_FAULTS="in_tool")
    run_id = enqueue_run("tool_agents:misbehaving", script_task("wire"), connection=r)
    run = wait_for_run(run_id, timeout=40, connection=r)

    assert run.status == "completed", (run.error, pool.logs())
    (result,) = results_of(run)
    assert result["is_error"] and "status of this wire_money call is unknown" in result["content"], result
    assert Counter(e["tool"] for e in pool.effects())["wire_money"] == 1
    assert "verify hook of wire_money gave no answer within 1.0s" in pool.logs(tail=10**6)


def _threads_and_cpu(pid: int, interval: float = 1.0) -> tuple[int, float] | None:
    """The number of threads of ``pid`` and the CPU it used over ``interval`` (1.0 = one core), from
    /proc; None if the process ended meanwhile."""

    def cpu_ticks() -> int:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    try:
        before = cpu_ticks()
        time.sleep(interval)
        used = (cpu_ticks() - before) / os.sysconf("SC_CLK_TCK") / interval
        return len(os.listdir(f"/proc/{pid}/task")), used
    except FileNotFoundError:
        return None


def test_tool_threads_spinning_past_their_timeout_do_not_stay_in_a_threaded_worker(r, pool, model):
    model.set_scripts({"spin": [{"tool_calls": [{"name": "crunch", "input": {"n": 1}}]}, {"text": "Gave up."}]})
    supervisor = start_threaded(pool, "spinner", concurrency=4, AGENTPOOL_MAX_ABANDONED_TOOLS="3")
    first = worker_process(supervisor)
    deadline = time.monotonic() + 30
    while not r.sismember("rq:workers", "rq:worker:spinner") and time.monotonic() < deadline:
        time.sleep(0.05)
    idle = _threads_and_cpu(first, 0.2)
    assert idle is not None
    idle_threads = idle[0]

    run_ids = [enqueue_run("tool_agents:misbehaving", script_task("spin", f"job {i}"), connection=r) for i in range(6)]
    for run_id in run_ids:
        run = wait_for_run(run_id, timeout=90, connection=r)
        assert run.status == "completed" and run.result == "Gave up.", (run.error, pool.logs())
        (result,) = results_of(run)
        assert result["is_error"] and "timed out after 1 s" in result["content"]
    assert Counter(e["tool"] for e in pool.effects())["crunch"] == len(run_ids), "no call ran twice"

    # Afterwards the worker process holds no spinning thread: each abandoned one went with a recycled process.
    deadline = time.monotonic() + 30
    while True:
        pid = worker_process(supervisor)
        measured = _threads_and_cpu(pid)
        # +1: the lease keeper thread a process starts with its first turn
        if measured is not None and measured[0] <= idle_threads + 1 and measured[1] < 0.25:
            break
        assert time.monotonic() < deadline, (
            f"worker {pid}: (threads, CPU) {measured}, idle {idle_threads}\n{pool.logs()}"
        )
    assert supervisor.poll() is None
    assert "recycling this process" in pool.logs(tail=10**6)
