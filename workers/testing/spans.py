"""A span exporter for tests of traced workers: every finished span as one JSON line appended to the
file named by ``AGENTPOOL_TEST_SPANS``. Selected like any exporter, by ``OTEL_TRACES_EXPORTER=agentpool_jsonl``
(an ``opentelemetry_traces_exporter`` entry point), so a worker process is configured as in production.
``AGENTPOOL_TEST_SPANS_HANG=<seconds>``: each export first waits that long, as a collector that takes the
connection and never answers would keep its caller waiting."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def _plain(attributes: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "kind": span.kind.name,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "events": [{"name": e.name, "attributes": _plain(e.attributes)} for e in span.events],
        "resource": _plain(span.resource.attributes),
        "attributes": _plain(span.attributes),
        "pid": os.getpid(),
        # When it ran (ns since the epoch): processes export in batches, so the file's order is not the spans'.
        "start": span.start_time,
        "end": span.end_time,
    }


class FileSpanExporter(SpanExporter):
    """``path``: where an app's own provider writes (a test's app that sets one up), else the variable's."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.environ["AGENTPOOL_TEST_SPANS"]
        self.hang = float(os.environ.get("AGENTPOOL_TEST_SPANS_HANG") or 0)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        time.sleep(self.hang)
        with open(self.path, "a") as f:  # O_APPEND: each write lands whole
            f.write("".join(json.dumps(span_record(s)) + "\n" for s in spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_spans(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
