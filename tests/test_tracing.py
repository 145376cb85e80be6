"""OpenTelemetry traces: real worker processes export their spans with OTEL_TRACES_EXPORTER (the tests'
file exporter, agentpool.testing.spans), the app's own span comes from the SDK's in-memory exporter in
this process, and the run's trace is read back whole across work horses SIGKILLed mid-tool."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentpool import enqueue_run, wait_for_run
from agentpool.store.keys import RunKeys
from agentpool.testing.spans import read_spans

from conftest import assert_valid_conversation, script_task

APP_SPANS = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(APP_SPANS))
APP = _provider.get_tracer("the-app")  # not installed globally: the app's span is made current below

SCRIPT = [
    {"tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {"tool_calls": [{"name": "send_email", "input": {"to": "team@example.com", "subject": "Friday", "body": "Ship"}}]},
    {"text": "All done."},
]


@pytest.mark.crash
def test_a_runs_trace_is_one_trace_under_the_apps_span_across_every_worker_and_takeover(r, pool, model, tmp_path):
    model.set_scripts({"traced": SCRIPT})
    spans_file = tmp_path / "spans.jsonl"
    pool.start(
        2, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file), AGENTPOOL_FAULTS="in_tool"
    )
    with APP.start_as_current_span("POST /release") as app_span:
        run_id = enqueue_run("pool_agents:support", script_task("traced"), connection=r)
    run = wait_for_run(run_id, timeout=180, connection=r)
    assert run.status == "completed", (run.error, pool.logs())
    assert_valid_conversation(run.messages)

    app_ctx = app_span.get_span_context()
    # The last turn exports its spans after it wrote the run's status: wait for its model call's.
    spans = _wait_for_spans(
        spans_file,
        lambda got: any(s["attributes"].get("gen_ai.response.finish_reasons") == ["end_turn"] for s in got),
        "span of the run's last model call",
    )
    assert spans, pool.logs()
    assert {s["trace_id"] for s in spans} == {f"{app_ctx.trace_id:032x}"}, "one trace, the app's, in every worker"
    (root,) = [s for s in spans if s["name"] == "invoke_agent pool_agents:support"]
    assert root["parent_id"] == f"{app_ctx.span_id:016x}"
    turns = [s for s in spans if s["name"].startswith("turn ")]
    ids = {s["span_id"] for s in spans} | {f"{app_ctx.span_id:016x}"}
    assert all(s["parent_id"] in ids for s in spans), (
        "no span whose parent is missing (a killed horse's tool phase is lost whole)"
    )
    assert turns and all(s["parent_id"] == root["span_id"] for s in turns), "each turn a child of the run's span"
    assert len({s["pid"] for s in turns}) >= 2, "turns exported by more than one process (horses taken over)"
    turn_ids = {s["span_id"] for s in turns}

    chats = [s for s in spans if s["name"] == "chat claude-sonnet-5-5"]
    assert chats and all(c["parent_id"] in turn_ids and c["kind"] == "CLIENT" for c in chats)
    # The run's last model call: the one that ended last (each process exports its spans in batches, so
    # the file's last chat span may be an earlier call's).
    attrs = max(chats, key=lambda s: s["end"])["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.provider.name"] == "anthropic"
    assert attrs["gen_ai.request.model"] == "claude-sonnet-5-5"
    assert attrs["gen_ai.response.finish_reasons"] == ["end_turn"]
    for name in ("input_tokens", "output_tokens", "cache_read.input_tokens", "cache_creation.input_tokens"):
        assert isinstance(attrs[f"gen_ai.usage.{name}"], int)

    tools = [s for s in spans if s["name"].startswith("execute_tool ")]
    outcomes = Counter((s["attributes"]["gen_ai.tool.name"], s["attributes"]["agentpool.tool.outcome"]) for s in tools)
    assert outcomes[("send_email", "unknown")] == 1, "the unsafe call after its horse died: reconciled, not re-run"
    assert outcomes[("read_notes", "ran")] >= 1
    effects = {s["attributes"]["gen_ai.tool.name"]: s["attributes"]["agentpool.tool.effect"] for s in tools}
    assert effects == {"read_notes": "read", "send_email": "unsafe"}

    takeovers = [s for s in spans if s["name"] == "agentpool.takeover"]
    assert len(takeovers) == 2 and all(s["parent_id"] == root["span_id"] for s in takeovers)
    assert {s["attributes"]["agentpool.takeover.cause_kind"] for s in takeovers} == {"horse_death"}
    names = Counter(s["name"] for s in spans)
    assert names["agentpool.save_point A"] >= 3 and names["agentpool.save_point B"] >= 2
    assert names["agentpool.reconcile"] == 2


def test_with_tracing_off_a_run_carries_no_trace_and_workers_send_no_span(r, pool, model, tmp_path):
    model.set_scripts({"plain": [{"text": "Hi."}]})
    pool.start(1, AGENTPOOL_TEST_SPANS=str(tmp_path / "spans.jsonl"))
    run_id = enqueue_run("pool_agents:support", script_task("plain"), connection=r)
    assert wait_for_run(run_id, timeout=120, connection=r).status == "completed"
    header = r.hgetall(RunKeys.of(run_id).run)
    assert b"trace" not in header and b"trace_parent" not in header
    assert not (tmp_path / "spans.jsonl").exists()


def test_an_approval_request_is_a_span_of_its_turn(r, pool, model, tmp_path):
    from agentpool import approve

    from conftest import wait_for_status

    model.set_scripts({"ask": [{"tool_calls": [{"name": "deploy", "input": {"version": "1.2"}}]}, {"text": "Done."}]})
    spans_file = tmp_path / "spans.jsonl"
    pool.start(1, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file))
    run_id = enqueue_run("pool_agents:guarded", script_task("ask"), connection=r)
    wait_for_status(r, run_id, "waiting_approval", timeout=120)
    approve(run_id, connection=r)
    assert wait_for_run(run_id, timeout=120, connection=r).status == "completed"
    spans = read_spans(str(spans_file))
    (request,) = [s for s in spans if s["name"] == "agentpool.approval_request"]
    assert request["attributes"]["agentpool.tools"] == "deploy"
    (deploy,) = [s for s in spans if s["name"] == "execute_tool deploy"]
    assert (
        deploy["attributes"]["agentpool.approval"] == "approved"
        and deploy["attributes"]["agentpool.tool.outcome"] == "ran"
    )
    assert len({s["trace_id"] for s in spans}) == 1, "a root trace when the app had no span"


def test_compose_runs_an_otlp_collector_beside_the_workers_and_points_them_at_it():
    import yaml

    from conftest import ROOT

    services = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())["services"]
    collector = services["otel-collector"]
    assert collector["profiles"] == ["traces"]
    config = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    assert config["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in services["worker"]["environment"]
    assert "'.[otel]'" in (ROOT / "deploy" / "Dockerfile").read_text()


def _wait_for_spans(path, wanted: Callable[[list[dict]], bool], what: str, timeout: float = 60) -> list[dict]:
    """The spans exported so far, once ``wanted`` holds of them: a turn exports its last spans after the
    run's status is written, so a test reading them as the run ends could miss them."""
    deadline = time.monotonic() + timeout
    while True:
        spans = read_spans(str(path))
        if wanted(spans):
            return spans
        assert time.monotonic() < deadline, f"no {what} in {json.dumps(spans)[:3000]}"
        time.sleep(0.05)


def test_an_api_error_that_echoes_the_key_leaves_it_in_no_span(r, pool, model, tmp_path):
    """The privacy test's gateway that echoes the request's headers, with tracing on: the chat span's
    error names the error, scrubbed, and no span carries the key or the token (the SDK's own exception
    record would: its stack trace holds the raw API error the model error is raised from)."""
    key = "sk-test-not-a-secret"  # the key the pool's workers are given (conftest)
    echoed = (
        f"invalid x-api-key {key}; request headers: {{'x-api-key': '{key}', "
        "'Authorization': 'Bearer sk-ant-api03-ANOTHER_SECRET_TOKEN'}"
    )
    model.set_scripts({"echo": [{"error": {"status": 401, "type": "authentication_error", "message": echoed}}]})
    spans_file = tmp_path / "spans.jsonl"
    pool.start(1, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file))
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("echo"), connection=r), timeout=60, connection=r)
    assert run.status == "failed" and "authentication_error" in run.error, run.error

    spans = _wait_for_spans(spans_file, lambda got: any(s["name"].startswith("turn ") for s in got), "turn span")
    exported = json.dumps(spans)
    for secret in (key, "ANOTHER_SECRET_TOKEN"):
        assert secret not in exported, secret
    (chat,) = [s for s in spans if s["name"] == "chat claude-sonnet-5-5"]
    assert chat["status"] == "ERROR" and "authentication_error" in chat["status_description"]
    (error,) = [e["attributes"] for e in chat["events"] if e["name"] == "exception"]
    assert error["exception.type"] == "ModelRejected" and "authentication_error" in error["exception.message"]
    assert "exception.stacktrace" not in error
    assert chat["attributes"]["error.type"] == "ModelRejected", "required by the GenAI conventions on a failed span"


SLOW_TOOL = [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 2}}]}, {"text": "Done."}]


def _run_seconds(r, script: str) -> float:
    """Seconds from enqueueing a run of ``script`` to its completion."""
    started = time.monotonic()
    run = wait_for_run(enqueue_run("pool_agents:support", script_task(script), connection=r), timeout=60, connection=r)
    assert run.status == "completed", run.error
    return time.monotonic() - started


def test_a_collector_that_never_answers_holds_up_no_turn(r, pool, model, tmp_path):
    """The exporter hangs on every export (a collector that takes the connection and never answers):
    the SDK's flush would wait for it in the turn's thread, at every flush of every turn, and the run
    would never end. A run of two turns (a horse each, a 2 s tool) takes about as long with the hung
    exporter as untraced; the worker says the export goes on in the background."""
    model.set_scripts({"slow": SLOW_TOOL, "warm": [{"text": "Hi."}]})
    untraced = pool.start(1)[0]
    _run_seconds(r, "warm")  # the worker's start-up (imports, connections) is not what is measured
    off = _run_seconds(r, "slow")
    pool.kill(untraced)

    spans_file = tmp_path / "spans.jsonl"
    pool.start(
        1,
        OTEL_TRACES_EXPORTER="agentpool_jsonl",
        AGENTPOOL_TEST_SPANS=str(spans_file),
        AGENTPOOL_TEST_SPANS_HANG="3600",
    )
    _run_seconds(r, "warm")
    hung = _run_seconds(r, "slow")
    print(f"untraced {off:.2f} s, exporter hung {hung:.2f} s")
    assert hung < 2 * off, f"a run took {hung:.2f} s with the exporter hung, {off:.2f} s untraced"
    assert "the span exporter did not finish" in pool.logs(tail=1_000_000), "the exporter did hang"
    assert not read_spans(str(spans_file)), "no export ever finished"


READ_TWICE = [
    {"tool_calls": [{"name": "read_notes", "input": {"topic": "release"}}]},
    {"tool_calls": [{"name": "read_notes", "input": {"topic": "risks"}}]},
    {"text": "Ships Friday."},
]


def test_a_forking_workers_horses_export_as_the_worker_one_service_instance(r, pool, model, tmp_path):
    """Tracing is set up in the worker before it forks: each turn's horse inherits its provider (the
    SDK restarts the batch thread in the child, so the horse's spans are exported) and its
    service.instance.id, instead of building a provider of its own, a new instance every turn."""
    model.set_scripts({"read": READ_TWICE})
    spans_file = tmp_path / "spans.jsonl"
    pool.start(1, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file))
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("read"), connection=r), timeout=60, connection=r)
    assert run.status == "completed", run.error
    spans = _wait_for_spans(spans_file, lambda got: any(s["name"] == "turn 2" for s in got), "turn 2")
    turns = [s for s in spans if s["name"].startswith("turn ")]
    assert len({s["pid"] for s in turns}) == 3, "each turn in a horse of its own"
    assert pool.workers[0].pid not in {s["pid"] for s in spans}, "every span exported by a horse"
    assert len({s["resource"]["service.instance.id"] for s in spans}) == 1, "the worker's instance, in every horse"
    assert {s["resource"]["service.name"] for s in spans} == {"agentpool"}, "the default name"


def test_a_service_name_given_in_otel_resource_attributes_is_kept(r, pool, model, tmp_path):
    model.set_scripts({"plain": [{"text": "Hi."}]})
    spans_file = tmp_path / "spans.jsonl"
    pool.start(
        1,
        OTEL_TRACES_EXPORTER="agentpool_jsonl",
        AGENTPOOL_TEST_SPANS=str(spans_file),
        OTEL_RESOURCE_ATTRIBUTES="service.name=billing-agents,deployment.environment.name=staging",
    )
    run = wait_for_run(enqueue_run("pool_agents:support", script_task("plain"), connection=r), timeout=60, connection=r)
    assert run.status == "completed", run.error
    spans = _wait_for_spans(spans_file, lambda got: any(s["name"] == "turn 0" for s in got), "turn 0")
    assert {s["resource"]["service.name"] for s in spans} == {"billing-agents"}
    assert {s["resource"]["deployment.environment.name"] for s in spans} == {"staging"}


def test_a_sub_agents_run_is_traced_in_its_parents_trace(r, pool, model, tmp_path):
    """A child run's spans are in the trace of the parent that started it, under the parent's turn."""
    model.set_scripts(
        {
            "lead": [
                {"tool_calls": [{"name": "researcher", "input": {"task": "Look [script:research]"}}]},
                {"text": "ok"},
            ],
            "research": [{"text": "found"}],
        }
    )
    spans_file = tmp_path / "spans.jsonl"
    pool.start(2, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file))
    run_id = enqueue_run("subagent_agents:orchestrator", script_task("lead"), connection=r)
    done = wait_for_run(run_id, timeout=120, connection=r)
    assert done.status == "completed", done.error
    (child,) = done.children
    spans = read_spans(str(spans_file))
    runs = {s["attributes"].get("agentpool.run.id"): s for s in spans if s["name"].startswith("invoke_agent")}
    assert {run_id, child} <= set(runs), sorted(s["name"] for s in spans)
    assert runs[child]["trace_id"] == runs[run_id]["trace_id"], "one trace for the tree"
    by_id = {s["span_id"]: s for s in spans}
    parent_span = by_id.get(runs[child]["parent_id"])
    assert parent_span is not None and parent_span["attributes"].get("agentpool.run.id", run_id) == run_id


def test_a_tool_span_exported_before_its_horse_is_killed_still_has_its_parent(r, pool, model, tmp_path):
    """The batch processor exports finished spans on its own schedule (100 ms here): a read tool's span is
    out while the next tool still runs, and the horse is then killed in that tool. The tool's span has a
    parent that was exported before it (the turn's span, out since save point A)."""
    calls = [{"name": "read_notes", "input": {"topic": "a"}}, {"name": "slow_read", "input": {"seconds": 1}}]
    model.set_scripts({"two": [{"tool_calls": calls}, {"text": "done"}]})
    arms = tmp_path / "arms"
    arms.mkdir()
    run_id = "r_orphan_spans_1"
    (arms / f"in_tool-{run_id}").write_text("slow_read")
    spans_file = tmp_path / "spans.jsonl"
    pool.start(
        2,
        OTEL_TRACES_EXPORTER="agentpool_jsonl",
        AGENTPOOL_TEST_SPANS=str(spans_file),
        OTEL_BSP_SCHEDULE_DELAY="100",
        AGENTPOOL_FAULT_ARMS=str(arms),
    )
    enqueue_run("pool_agents:support", script_task("two"), run_id=run_id, connection=r)
    assert wait_for_run(run_id, timeout=120, connection=r).status == "completed"
    assert list(arms.glob("fired-*")), "the horse was killed in slow_read"
    spans = read_spans(str(spans_file))
    ids = {s["span_id"] for s in spans}
    reads = [s for s in spans if s["name"] == "execute_tool read_notes"]
    assert len(reads) >= 1 and all(s["parent_id"] in ids for s in reads), "a tool span exported without its parent"
    assert all(s["parent_id"] in ids for s in spans if s["parent_id"]), "no exported span lacks its parent"


def test_a_worker_stops_at_once_while_its_export_to_a_collector_that_never_answers_hangs(r, pool, model, tmp_path):
    """A horse killed in a tool: its worker records the takeover and exports it, to an exporter that
    hangs (a collector that takes the connection and never answers), and that export goes on in the
    background. Stopped by a deploy's SIGTERM once the run is done, the worker exits as an untraced one
    does (about 2 s), not after the SDK's exit-time shutdown, which waits 30 s for that export."""
    model.set_scripts({"slow": [{"tool_calls": [{"name": "slow_read", "input": {"seconds": 1}}]}, {"text": "Done."}]})
    arms = tmp_path / "arms"
    arms.mkdir()
    run_id = "r_stop_hung_export_1"
    (arms / f"in_tool-{run_id}").write_text("slow_read")
    (worker,) = pool.start(
        1,
        OTEL_TRACES_EXPORTER="agentpool_jsonl",
        AGENTPOOL_TEST_SPANS=str(tmp_path / "spans.jsonl"),
        AGENTPOOL_TEST_SPANS_HANG="3600",
        AGENTPOOL_FAULT_ARMS=str(arms),
    )
    enqueue_run("pool_agents:support", script_task("slow"), run_id=run_id, connection=r)
    assert wait_for_run(run_id, timeout=120, connection=r).status == "completed"
    assert list(arms.glob("fired-*")), "the horse was killed in slow_read"
    pool.wait_for_log(lambda line: "takeover" in line and run_id in line, "of the takeover")
    started = time.monotonic()
    pool.kill(worker, signal.SIGTERM, with_horse=False)
    worker.wait(timeout=120)
    stopped = time.monotonic() - started
    assert worker.returncode == 0, pool.logs()
    assert stopped < 10, f"the worker took {stopped:.1f} s to stop"


APP_MODULE = '''
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agentpool import Agent, tool
from agentpool.testing.spans import FileSpanExporter

# The app's own telemetry, set up when its agents' module is imported (a worker does that once it runs).
provider = TracerProvider(resource=Resource.create({"service.name": "the-app"}))
provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(os.environ["APP_SPANS"])))
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("the-app")


@tool(effect="read")
def lookup_order(order: str) -> str:
    """Look an order up."""
    with tracer.start_as_current_span("lookup order"):
        return f"order {order}: shipped"


support = Agent(model="claude-sonnet-5-5", tools=[lookup_order])
'''


@pytest.mark.parametrize("agentpool_exports", [True, False], ids=["otel-variables-set", "no-otel-variables"])
def test_an_app_that_sets_up_its_provider_in_its_agents_module_keeps_it(r, pool, model, tmp_path, agentpool_exports):
    """The app's module sets its own tracer provider up at import, after the worker started (and decided
    about tracing). Its set_tracer_provider is not refused, its own span inside a tool goes to its own
    exporter under its own service name, a child of agentpool's execute_tool span, and agentpool's spans
    go through the app's provider from then on, whether or not the OTEL_* variables turned agentpool's
    own provider on."""
    from conftest import TESTS

    (tmp_path / "app_with_telemetry.py").write_text(APP_MODULE)
    app_spans, own_spans = tmp_path / "app-spans.jsonl", tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "agentpool_jsonl", "AGENTPOOL_TEST_SPANS": str(own_spans)}
    pool.start(
        1, PYTHONPATH=f"{tmp_path}{os.pathsep}{TESTS}", APP_SPANS=str(app_spans), **(env if agentpool_exports else {})
    )
    model.set_scripts({"app": [{"tool_calls": [{"name": "lookup_order", "input": {"order": "1042"}}]}, {"text": "ok"}]})
    # check_agent=False: the app's module would set this test process's global provider up too.
    run_id = enqueue_run("app_with_telemetry:support", script_task("app"), check_agent=False, connection=r)
    assert wait_for_run(run_id, timeout=120, connection=r).status == "completed", pool.logs()

    spans = _wait_for_spans(app_spans, lambda got: any(s["name"] == "turn 1" for s in got), "turn 1 in the app's")
    assert "Overriding of current TracerProvider is not allowed" not in pool.logs(tail=1_000_000)
    (own,) = [s for s in spans if s["name"] == "lookup order"]
    assert own["resource"]["service.name"] == "the-app"
    (tool_span,) = [s for s in spans if s["name"] == "execute_tool lookup_order"]
    assert own["parent_id"] == tool_span["span_id"] and own["trace_id"] == tool_span["trace_id"]
    assert {s["resource"]["service.name"] for s in spans} == {"the-app"}, "agentpool's spans through the app's"
    assert {s["trace_id"] for s in spans} == {tool_span["trace_id"]}, "one trace for the run"
    assert not any(s["name"] == "lookup order" for s in read_spans(str(own_spans)))


def test_a_chat_span_counts_input_tokens_as_the_genai_conventions_do(r, pool, model, tmp_path):
    """Anthropic counts cached input tokens apart from ``input_tokens``; the GenAI conventions'
    ``gen_ai.usage.input_tokens`` includes them (their Anthropic page: input_tokens + cache_read +
    cache_creation). A streamed call says so (``gen_ai.request.stream``) and names the server it called
    (``server.address``/``server.port``: the API, or a gateway), and the run's invoke_agent span names
    its provider (required)."""
    usage = {"input_tokens": 7, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 200}
    model.set_scripts({"cached": [{"text": "Hi.", "usage": {**usage, "output_tokens": 5}}]})
    spans_file = tmp_path / "spans.jsonl"
    pool.start(1, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file))
    run = wait_for_run(
        enqueue_run("pool_agents:support", script_task("cached"), connection=r), timeout=60, connection=r
    )
    assert run.status == "completed", run.error
    spans = _wait_for_spans(spans_file, lambda got: any(s["name"] == "turn 0" for s in got), "turn 0")
    (chat,) = [s["attributes"] for s in spans if s["name"] == "chat claude-sonnet-5-5"]
    assert chat["gen_ai.usage.input_tokens"] == 1207
    assert chat["gen_ai.usage.cache_read.input_tokens"] == 1000
    assert chat["gen_ai.usage.cache_creation.input_tokens"] == 200
    assert chat["gen_ai.usage.output_tokens"] == 5
    assert chat["gen_ai.request.stream"] is True
    called = urllib.parse.urlsplit(model.base_url)
    assert (chat["server.address"], chat["server.port"]) == (called.hostname, called.port), chat
    (root,) = [s["attributes"] for s in spans if s["name"] == "invoke_agent pool_agents:support"]
    assert root["gen_ai.operation.name"] == "invoke_agent" and root["gen_ai.provider.name"] == "anthropic"


def test_no_span_carries_the_task_a_tool_input_its_result_or_the_models_words(r, pool, model, tmp_path):
    """The GenAI conventions make message and tool content opt-in (it is the user's data): no span of
    agentpool's carries it, nor the anthropic SDK's spans in a worker that traces from the variables."""
    model.set_scripts(
        {
            "private": [
                {"tool_calls": [{"name": "read_notes", "input": {"topic": "quokka-5521"}}]},
                {"text": "The plan is walrus-8830."},
            ]
        }
    )
    spans_file = tmp_path / "spans.jsonl"
    pool.start(1, OTEL_TRACES_EXPORTER="agentpool_jsonl", AGENTPOOL_TEST_SPANS=str(spans_file))
    task = script_task("private", "Summarize the heron-4417 notes")
    run = wait_for_run(enqueue_run("pool_agents:support", task, connection=r), timeout=60, connection=r)
    assert run.status == "completed", run.error
    spans = _wait_for_spans(spans_file, lambda got: any(s["name"] == "turn 1" for s in got), "turn 1")
    assert any(s["name"] == "execute_tool read_notes" for s in spans)
    exported = json.dumps(spans)
    for private in ("heron-4417", "quokka-5521", "ship the release on Friday", "walrus-8830"):
        assert private not in exported, private
