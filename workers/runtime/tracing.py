"""OpenTelemetry traces of runs: one trace per run, across every worker that touched it.

On when the standard variables say so: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, any exporter
installed under the ``opentelemetry_traces_exporter`` entry point group) or an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), with ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES`` and the exporters' own variables; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` keeps it off. It needs the SDK: ``pip install 'agentpool[otel]'``. A
process whose app sets up its own SDK tracer provider (made global) is traced through that one, from the
next turn on when it does so later; agentpool's own provider is never made the global one, so an app's
is never refused. Off, every hook is one check of a module global (a turn's start also looks at
OpenTelemetry's global provider): no span, no attribute built, no Redis command.

The trace's shape: ``enqueue_run`` keeps the app's current span (if any) with the run
(``trace_parent`` in its header, in the create transaction); the first traced turn opens the run's
span, ``invoke_agent <agent>``, as its child and keeps it with the run (``trace``); every turn, in
whichever worker, is a child of that span, and the model calls (``chat <model>``, GenAI semantic
conventions), tool calls (``execute_tool <name>``), save points, approval requests and compactions of
the turn are children of the turn. Takeovers are spans of their own under the run's span.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from redis import Redis

from agentpool.store.keys import RunKeys

log = logging.getLogger("agentpool.tracing")
INSTALL_HINT = "OpenTelemetry traces need the otel extra: pip install 'agentpool[otel]'"
TRACE_FIELD = "trace"  # the run span's traceparent, in the run's header
PARENT_FIELD = "trace_parent"  # the app's span enqueue_run was called in

_UNSET: Any = object()
_tracer: Any = _UNSET
_provider: Any = None
# How long a flush may hold up a turn. The SDK's force_flush ignores its timeout and exports in the
# caller's thread, so a collector that is down or never answers would stall every turn for the
# exporter's own timeouts and retries (seconds each); a local collector answers in milliseconds.
FLUSH_WAIT = 0.5
_flushing: threading.Thread | None = None  # this process's flush still in flight, if one is


def _wanted() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters == "none":
        return False
    return bool(
        exporters
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _exporter(name: str) -> Any:
    from importlib.metadata import entry_points

    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found and name == "otlp":  # the default: gRPC's name; the otel extra installs OTLP over HTTP
        found = list(entry_points(group="opentelemetry_traces_exporter", name="otlp_proto_http"))
    if not found:
        hint = " (pip install opentelemetry-exporter-otlp)" if name.startswith("otlp") else ""
        raise ValueError(f"OTEL_TRACES_EXPORTER names {name!r}, which no installed package provides{hint}")
    return found[0].load()()


def _app_provider() -> Any:
    """The SDK tracer provider the app made global, if it has: spans go where its spans go. An app that
    never imported OpenTelemetry has none, and nothing is imported for it."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace

    current = trace.get_tracer_provider()
    return current if hasattr(current, "add_span_processor") else None


def _setup() -> Any:
    global _provider
    app = _app_provider()
    if app is not None:
        _provider = app
        return app.get_tracer("agentpool")
    if not _wanted():
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("%s; runs are not traced", INSTALL_HINT)
        return None
    # Never made the global provider: an app that sets up its own later (its agents' module, imported
    # once the worker runs) would be refused ("Overriding of current TracerProvider is not allowed"),
    # and its own spans would go to agentpool's exporter under agentpool's name. Nor shut down by the
    # SDK at exit: that waits up to 30 s for an export to a collector that is down (``_at_exit``).
    provider = TracerProvider(resource=_resource(Resource), shutdown_on_exit=False)
    _keep_instance_across_forks(provider, Resource)
    for name in (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
        try:
            provider.add_span_processor(BatchSpanProcessor(_exporter(name.strip())))
        except Exception as exc:  # noqa: BLE001 - a bad exporter setting must not stop the worker
            log.warning("traces not exported to %s: %s", name.strip(), exc)
    atexit.register(_at_exit, provider)
    _provider = provider
    return provider.get_tracer("agentpool")


def _at_exit(provider: Any) -> None:
    """A process that exits (a worker stopped by a deploy) exports what it has left as a turn does, waiting
    at most ``FLUSH_WAIT``, and not at all while an earlier export still hangs."""
    if _provider is provider:
        flush()


def _resource(resource_class: Any) -> Any:
    """The SDK's resource (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, detectors), named
    ``agentpool`` only when neither variable names the service (the SDK's fallback, ``unknown_service``)."""
    detected = resource_class.create()
    if str(detected.attributes.get("service.name", "")).startswith("unknown_service"):
        return detected.merge(resource_class({"service.name": "agentpool"}))
    return detected


def _keep_instance_across_forks(provider: Any, resource_class: Any) -> None:
    """A forking worker's horses are this worker, one turn each: they keep its ``service.instance.id``.
    The SDK gives every forked process a new one (``TracerProvider._handle_fork``), which would make
    each turn a service instance of its own. This at-fork hook is registered after the provider's, so
    it runs after it (``os.register_at_fork`` runs child hooks in registration order)."""
    instance = provider.resource.attributes.get("service.instance.id")
    # What the SDK's own at-fork hook calls; an SDK without it has no such hook either, and a horse
    # keeps the inherited resource as it is.
    update = getattr(provider, "_update_resource", None)
    if instance is None or update is None or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(after_in_child=lambda: update(resource_class({"service.instance.id": instance})))


def tracer() -> Any:
    """The tracer runs are traced with, or None when tracing is off (decided once per process, and again
    by ``_follow_app`` at each turn's start, for an app that sets up its provider later)."""
    global _tracer
    if _tracer is _UNSET:
        try:
            _tracer = _setup()
        except ImportError:
            _tracer = None
    return _tracer


def _follow_app() -> Any:
    """``tracer()``, through the app's own provider if it has set one up since this process decided: a
    worker imports an agent's module (which may set it up) after it starts, and a forking worker
    decided before that."""
    global _tracer, _provider
    current = tracer()
    app = _app_provider()
    if app is not None and app is not _provider:
        _provider, _tracer = app, app.get_tracer("agentpool")
        return _tracer
    return current


def flush() -> None:
    """Export what this process traced: a forking worker's horse ends with ``os._exit``, and the batch
    processor's thread would take its spans with it. Waits at most ``FLUSH_WAIT``: an export that takes
    longer goes on in a background thread, and while it does, a flush adds nothing to it and waits for
    nothing (that export takes the spans ended meanwhile too: the SDK's flush exports until its queue
    is empty). A horse that ends first loses those spans, never its turn's time."""
    global _flushing
    if _provider is None or tracer() is None:
        return
    if _flushing is not None and _flushing.is_alive():
        return  # the collector is already slow to answer: waiting again would only stall the turn
    # Two threads racing here start two flushes, the second waiting on the SDK's export lock: harmless.
    _flushing = threading.Thread(target=_provider.force_flush, name="agentpool-trace-flush", daemon=True)
    started = time.monotonic()
    _flushing.start()
    _flushing.join(FLUSH_WAIT)
    if _flushing.is_alive():
        log.warning(
            "traces: the span exporter did not finish within %.1f s; its export goes on in the background "
            "(is the collector down?) and no turn waits for it (flush waited %.2f s)",
            FLUSH_WAIT,
            time.monotonic() - started,
        )


def current_parent() -> str | None:
    """The traceparent of the caller's current span (an app's request span), if it has one. An app that
    never imported OpenTelemetry has none: nothing is imported for it."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return None
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


def _context(traceparent: str | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent} if traceparent else {})


def _traceparent_of(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _text(value: bytes | str | None) -> str | None:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def run_context(r: Redis, keys: RunKeys, header: dict[bytes, bytes], agent: str) -> Any:
    """The run's span as a parent context; the first traced turn opens it (a child of the app's span
    enqueue_run was called in) and keeps it with the run. Called only with tracing on."""
    known = _text(header.get(TRACE_FIELD.encode()))
    if not known:
        t = tracer()
        span = t.start_span(
            f"invoke_agent {agent}",
            context=_context(_text(header.get(PARENT_FIELD.encode()))),
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.provider.name": "anthropic",
                "gen_ai.agent.name": agent,
                "agentpool.run.id": keys.run_id,
            },
        )
        span.end()
        flush()  # out now, once per run: a horse killed later in this turn would take it with it
        mine = _traceparent_of(span)
        # HSETNX: the lease holder alone gets here, and a header never loses the field once set.
        known = mine if r.hsetnx(keys.run, TRACE_FIELD, mine) else _text(r.hget(keys.run, TRACE_FIELD))
    return _context(known)


class _TurnTrace:
    """The open span of a turn, current while it runs. ``tools_phase`` ends it at save point A (it is
    exported then) and opens ``turn <n> tools`` beside it (both children of the run's span): a horse
    killed in a tool then loses only the span of its tool phase, and every span exported has its parent."""

    def __init__(self, t: Any, parent: Any, turn: int, attributes: dict[str, Any]) -> None:
        self.t, self.parent, self.turn, self.attributes = t, parent, turn, attributes
        self._open(f"turn {turn}")

    def _open(self, name: str) -> None:
        from opentelemetry import context, trace

        self.span = self.t.start_span(name, context=self.parent, attributes=self.attributes)
        self._token = context.attach(trace.set_span_in_context(self.span))

    def close(self, exc: BaseException | None = None) -> None:
        from opentelemetry import context

        if exc is not None:
            record_error(self.span, exc)
        context.detach(self._token)
        self.span.end()

    def tools_phase(self) -> None:
        """The tool phase's spans are made children of the turn's span, ended and exported by now, not
        of ``turn <n> tools`` (which times the phase beside it): the batch processor exports a finished
        tool's span on its own schedule, and a horse killed later in the phase would leave it exported
        without its parent."""
        from opentelemetry import context, trace

        self.close()
        done = self.span
        self.span = self.t.start_span(f"turn {self.turn} tools", context=self.parent, attributes=self.attributes)
        self._token = context.attach(trace.set_span_in_context(done))


_current_turn: contextvars.ContextVar[_TurnTrace | None] = contextvars.ContextVar("agentpool_turn", default=None)


@contextlib.contextmanager
def turn_span(r: Redis, keys: RunKeys, turn: int, header: dict[bytes, bytes]) -> Iterator[Any]:
    """The span of one turn, current while it runs, child of the run's span. Off: nothing."""
    t = _follow_app()
    if t is None:
        yield None
        return
    agent = _text(header.get(b"agent")) or "?"
    parent = run_context(r, keys, header, agent)
    attributes = {"agentpool.run.id": keys.run_id, "agentpool.turn": turn, "gen_ai.agent.name": agent}
    current = _TurnTrace(t, parent, turn, attributes)
    mark = _current_turn.set(current)
    try:
        yield current
    except BaseException as exc:
        current.close(exc)
        raise
    else:
        current.close()
    finally:
        _current_turn.reset(mark)
        flush()


def tools_phase() -> None:
    """Save point A is written and the turn's tools come next (see ``_TurnTrace``); export what is done."""
    current = _current_turn.get()
    if current is not None:
        current.tools_phase()
        flush()


def record_error(span: Any, exc: BaseException) -> None:
    """The span failed with ``exc``: its type and its text, scrubbed of any API key or token, as the
    span's status and an ``exception`` event. Never the SDK's ``record_exception``: its
    ``exception.stacktrace`` holds the chained exceptions' texts, such as the raw API error a model
    error is raised from, which may echo the request's key or bearer token."""
    from opentelemetry.trace import Status, StatusCode

    from agentpool.runtime.model import scrub  # imported here: the model module imports this one

    kind, text = type(exc).__name__, scrub(str(exc))
    span.set_attribute("error.type", kind)  # the GenAI conventions require it on a span that failed
    span.add_event("exception", {"exception.type": kind, "exception.message": text})
    span.set_status(Status(StatusCode.ERROR, f"{kind}: {text}" if text else kind))


@contextlib.contextmanager
def _current_span(t: Any, name: str, kind: Any, attributes: dict[str, Any]) -> Iterator[Any]:
    with t.start_as_current_span(
        name, kind=kind, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except BaseException as exc:
            record_error(current, exc)
            raise


_OFF = contextlib.nullcontext()  # what every hook gets while tracing is off: no generator, no span


def span(name: str, *, client: bool = False, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child of the current span (a turn's), or a shared no-op when tracing is off. ``client``: a call
    out of the process (the model API), as the GenAI conventions make a chat span."""
    t = tracer()
    if t is None:
        return _OFF
    from opentelemetry.trace import SpanKind

    kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
    return _current_span(t, name, kind, {k: v for k, v in attributes.items() if v is not None})


def set_attributes(target: Any, **attributes: Any) -> None:
    if isinstance(target, _TurnTrace):
        target = target.span
    if target is not None:
        target.set_attributes({k: v for k, v in attributes.items() if v is not None})


def record_takeover(r: Redis, run_id: str, turn: int, cause: str, cause_kind: str, job: str) -> None:
    """A span for a takeover, under the run's span (read from its header: only with tracing on)."""
    t = _follow_app()
    if t is None:
        return
    known = _text(r.hget(RunKeys.of(run_id).run, TRACE_FIELD))
    if not known:
        return
    attributes = {
        "agentpool.run.id": run_id,
        "agentpool.turn": turn,
        "agentpool.takeover.cause": cause,
        "agentpool.takeover.cause_kind": cause_kind,
        "agentpool.job": job,
    }
    t.start_span("agentpool.takeover", context=_context(known), attributes=attributes).end()
    flush()
