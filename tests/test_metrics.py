"""`agentpool metrics` and `agentpool worker --metrics-port`: Prometheus text scraped over HTTP from
real processes, checked against what the runs themselves recorded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentpool import enqueue_run, get_run, wait_for_run
from agentpool.runtime.jobs import stage_turn
from agentpool.testing import settled_stats
from agentpool.testing.localpool import RedisServer, WorkerProcesses, free_port

from conftest import ROOT, script_task

MEETING = [
    {"text": "Let me read the notes.", "tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {
        "tool_calls": [
            {"name": "create_ticket", "input": {"title": "Changelog", "body": "Ana writes it"}},
            {
                "name": "send_email",
                "input": {"to": "team@example.com", "subject": "Release Friday", "body": "See ticket."},
            },
        ]
    },
    {"text": "The release ships Friday."},
]
LOOP = [{"tool_calls": [{"name": "read_notes", "input": {"topic": str(i)}}]} for i in range(10)]


def scrape(port: int, timeout: float = 120.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}, retrying until the server answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            break
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@contextmanager
def metrics_command(tmp_path: Path, env: dict[str, str], *args: str) -> Iterator[int]:
    port = free_port()
    with open(tmp_path / "metrics.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentpool", "metrics", "--port", str(port), "--host", "127.0.0.1", *args],
            env=env,
            cwd=str(ROOT),
            stdout=log,
            stderr=log,
        )
        try:
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def metrics_server(pool, tmp_path) -> Iterator[int]:
    with metrics_command(tmp_path, pool.env) as port:
        yield port


def test_metrics_command_exports_runs_tools_tokens_latency_and_queue_depth(r, pool, model, metrics_server):
    model.set_scripts({"meeting": MEETING, "loop": LOOP})
    pool.start(1)
    done = [enqueue_run("pool_agents:support", script_task("meeting"), connection=r) for _ in range(2)]
    stopped = enqueue_run("pool_agents:support", script_task("loop"), connection=r, max_turns=2)
    runs = [wait_for_run(i, timeout=60, connection=r) for i in [*done, stopped]]
    assert [run.status for run in runs] == ["completed", "completed", "stopped"]
    pool.stop(signal.SIGTERM)  # warm: the worker flushes its counters as it stops (a SIGKILL loses its last second)
    # A SIGKILLed worker's BLPOP can outlive it for a moment inside Redis and swallow the next job.
    deadline = time.monotonic() + 60
    while r.info("clients")["blocked_clients"] and time.monotonic() < deadline:
        time.sleep(0.05)
    waiting = [enqueue_run("pool_agents:support", script_task("meeting"), connection=r) for _ in range(2)]
    with r.pipeline(transaction=True) as pipe:  # a deferred retry of one of them, due in ten minutes
        pipe.multi()
        stage_turn(pipe, r, waiting[0], 0, attempt=1, delay=600)
        pipe.execute()

    settled_stats(r)  # the workers add their counters about once a second
    m = scrape(metrics_server)

    assert sample(m, "agentpool_redis_up") == 1
    assert sample(m, "agentpool_runs", status="completed") == 2
    assert sample(m, "agentpool_runs", status="stopped") == 1
    assert sample(m, "agentpool_runs", status="queued") == 2
    assert sample(m, "agentpool_runs", status="waiting_approval") == 0
    assert sample(m, "agentpool_runs_indexed") == 5
    assert sample(m, "agentpool_runs_active") == 2
    assert sample(m, "agentpool_queue_jobs", state="queued") == 2
    assert sample(m, "agentpool_queue_jobs", state="scheduled") == 0  # not an RQ job until due
    assert sample(m, "agentpool_turns_deferred") == 1
    assert sample(m, "agentpool_turns_deferred_overdue_seconds") == 0

    # 2 meeting runs (3 turns, one call of each effect class) + the loop: 2 turns of read_notes, and a
    # third that started and stopped at its max_turns guard before calling the model
    assert sample(m, "agentpool_turns_total") == 9
    assert sample(m, "agentpool_tool_calls_total", effect="read") == 4
    assert sample(m, "agentpool_tool_calls_total", effect="idempotent") == 2
    assert sample(m, "agentpool_tool_calls_total", effect="unsafe") == 2
    assert sample(m, "agentpool_takeovers_total", cause="horse_death") == 0
    for kind in ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert sample(m, "agentpool_tokens_total", kind=kind) == sum(run.usage[kind] for run in runs), kind
    assert sample(m, "agentpool_tokens_total", kind="output_tokens") > 0
    assert sample(m, "agentpool_status_changes_total", status="completed") == 2

    assert sample(m, "agentpool_model_call_seconds_count") == 8
    assert sample(m, "agentpool_model_call_seconds_bucket", le="+Inf") == 8
    assert sample(m, "agentpool_model_call_seconds_bucket", le="60.0") == 8  # the scripted model answers at once
    assert 0 < sample(m, "agentpool_model_call_seconds_sum") < 60
    # turns that ran tools: 2 per meeting run, 2 in the loop (its third turn stopped at the guard)
    assert sample(m, "agentpool_turn_seconds_count") == 6
    buckets = sorted(
        (float(dict(labels)["le"]), v) for (name, labels), v in m.items() if name == "agentpool_turn_seconds_bucket"
    )
    assert [le for le, _ in buckets] == [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf")]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == 6, "buckets are cumulative and end at the count"


def test_worker_metrics_port_serves_the_same_pool_wide_numbers(r, pool, model):
    model.set_scripts({"meeting": MEETING})
    port = free_port()
    WorkerProcesses.start(pool, 1, "--log-level", "INFO", "--metrics-port", str(port))  # Pool.start takes no flags
    run = wait_for_run(
        enqueue_run("pool_agents:support", script_task("meeting"), connection=r), timeout=60, connection=r
    )
    assert run.status == "completed", pool.logs()

    settled_stats(r)
    m = scrape(port)

    assert sample(m, "agentpool_runs", status="completed") == 1
    assert sample(m, "agentpool_tool_calls_total", effect="unsafe") == 1
    assert (
        sample(m, "agentpool_tokens_total", kind="output_tokens")
        == get_run(run.id, connection=r).usage["output_tokens"]
    )
    assert sample(m, "agentpool_workers") == 1
    assert sample(m, "agentpool_queue_jobs", state="queued") == 0


def test_metrics_report_redis_down_instead_of_failing_the_scrape(tmp_path):
    with metrics_command(tmp_path, dict(os.environ), "--url", f"redis://127.0.0.1:{free_port()}/0") as port:
        m = scrape(port)
    assert sample(m, "agentpool_redis_up") == 0
    assert not any(name.startswith("agentpool_runs") for name, _ in m)


def test_a_worker_scrape_reports_redis_down_while_redis_hangs_instead_of_hanging(tmp_path, model):
    server = RedisServer(tmp_path).start()  # its own: it is frozen below
    port = free_port()
    env = {**os.environ, "REDIS_URL": server.url, "ANTHROPIC_BASE_URL": model.base_url, "ANTHROPIC_API_KEY": "sk-t"}
    workers = WorkerProcesses(env, tmp_path, cwd=str(ROOT / "tests"))
    workers.start(1, "--no-scheduler", "--metrics-port", str(port))
    try:
        assert sample(scrape(port), "agentpool_redis_up") == 1
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # Redis hangs (a stuck primary, a paused VM): no error, no answer
        try:
            # Prometheus gives up after its scrape timeout (10 s by default); the scrape must answer first.
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15) as resp:
                text = resp.read().decode()
        finally:
            server.proc.send_signal(signal.SIGCONT)
        m = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        assert sample(m, "agentpool_redis_up") == 0
    finally:
        workers.stop()
        server.stop()


def test_cost_is_exported_once_the_pool_counters_carry_it(r):
    from prometheus_client import generate_latest

    from agentpool.ops.metrics import registry_for

    assert b"agentpool_cost_usd" not in generate_latest(registry_for(r))
    r.hincrbyfloat("ap:stats", "cost_usd", 0.125)
    assert b"agentpool_cost_usd_total 0.125" in generate_latest(registry_for(r))


def test_every_exported_metric_is_explained_in_the_docs(r):
    from prometheus_client import generate_latest

    from agentpool.ops.metrics import registry_for

    r.hincrbyfloat("ap:stats", "cost_usd", 0.125)  # exported only once there is spend
    families = {f.name for f in text_string_to_metric_families(generate_latest(registry_for(r)).decode())}
    page = (ROOT / "docs" / "operations.md").read_text()
    table = page[page.index("| metric | counts |") : page.index("- **Dashboard**")]
    missing = [name for name in families if not any(f"`{name}{end}" in table for end in ("`", "{", "_total"))]
    assert families and not missing, f"not explained in docs/operations.md's metrics table: {missing}"


def test_metrics_count_no_worker_whose_rq_record_expired(r, pool, model, metrics_server):
    """A worker killed whole stays in RQ's worker sets until something cleans them (`rq info`, a worker's
    maintenance every 10 minutes); its record expires within 90 s, and what the scrape counts must too."""
    pool.start(1)
    deadline = time.monotonic() + 60
    while sample(scrape(metrics_server), "agentpool_workers") != 1:
        assert time.monotonic() < deadline, pool.logs()
        time.sleep(0.2)
    # The worker's first maintenance (right after it starts) cleans RQ's worker sets of names without a
    # record: past it, the entries below stay until the test is done with them.
    pool.wait_for_log(lambda line: "cleaning group registries" in line, "of the worker's first maintenance")
    r.sadd("rq:workers", "rq:worker:gone")  # what a dead worker whose record expired leaves
    r.sadd("rq:workers:agentpool", "rq:worker:gone")

    m = scrape(metrics_server)
    assert sample(m, "agentpool_workers") == 1
    assert sample(m, "agentpool_workers_by_queue", queue="default") == 1

    r.hset("rq:worker:gone", "state", "busy")  # the same name with a record: counted
    m = scrape(metrics_server)
    assert sample(m, "agentpool_workers") == 2
    assert sample(m, "agentpool_workers_by_queue", queue="default") == 2
