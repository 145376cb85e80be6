"""OpenTelemetry traces: real worker processes export their spans with OTEL_TRACES_EXPORTER (the tests'
file exporter, agentpool.testing.spans), the app's own span comes from the SDK's in-memory exporter in
this process, and the run's trace is read back whole across work horses SIGKILLed mid-tool."""

from __future__ import annotations

from collections import Counter

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
    spans = read_spans(str(spans_file))
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
