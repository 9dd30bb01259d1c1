"""OpenTelemetry traces of calls: the caller's ``traceparent`` and the trace id.

Only ``opentelemetry-api`` is needed. Spans are made exactly when the host (or ``runner
serve``, see ``configure_from_env``) has set a tracer provider, before or after the runner
loaded. Without one the runner makes no span at all (``active_tracer`` is a global
lookup), yet every call still has a W3C trace id:
the caller's, when it sent a ``traceparent`` or runs inside a span of its own, else a
random one, so that the answer's ``traceId`` joins the caller's trace either way.

A ``traceparent`` is parsed by the API's ``TraceContextTextMapPropagator``; one that does
not parse is ignored (the call starts a trace of its own), never an error.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "runner"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# The service name ``runner serve`` reports when OTEL_SERVICE_NAME does not say one.
SERVICE_NAME = "runner"
_PROPAGATOR = TraceContextTextMapPropagator()
# Longer than any valid header: a caller's string is not parsed past this.
_MAX_HEADER = 512
# W3C ``tracestate``: up to 32 ``key=value`` members, comma separated, printable ASCII
# only. Anything else is dropped before OpenTelemetry sees it: it logs what it rejects,
# raw, and a caller's escape sequences and newlines would reach the operator's terminal.
_TRACESTATE_MEMBER = r"[a-z0-9][_0-9a-z\-*/@]{0,255}=[\x21-\x2b\x2d-\x3c\x3e-\x7e]{0,256}"
_TRACESTATE = re.compile(rf"{_TRACESTATE_MEMBER}(?:[ \t]*,[ \t]*{_TRACESTATE_MEMBER}){{0,31}}")


# The provider last seen and its tracer: one assignment, so a reader sees a matching pair.
_tracer_of: tuple[trace.TracerProvider, trace.Tracer] | None = None


def active_tracer() -> trace.Tracer | None:
    """The runner's tracer when a tracer provider of an SDK is set (the host's, or that of
    ``configure_from_env``), else None: then the API's spans would record nothing."""
    global _tracer_of  # noqa: PLW0603 - a cache, replaced whole
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    cached = _tracer_of
    if cached is not None and cached[0] is provider:
        return cached[1]
    tracer = provider.get_tracer(TRACER_NAME)
    _tracer_of = (provider, tracer)
    return tracer


def incoming_context(carrier: Mapping[str, Any] | None) -> Context | None:
    """The trace context a caller sent as ``traceparent`` (and ``tracestate``) in
    ``carrier``; None when it sent none or one that does not parse."""
    if not carrier:
        return None
    traceparent = carrier.get(TRACEPARENT)
    if not isinstance(traceparent, str) or len(traceparent) > _MAX_HEADER:
        return None
    headers = {TRACEPARENT: traceparent}
    tracestate = carrier.get(TRACESTATE)
    if isinstance(tracestate, str) and len(tracestate) <= _MAX_HEADER and _TRACESTATE.fullmatch(tracestate):
        headers[TRACESTATE] = tracestate
    context = _PROPAGATOR.extract(headers)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def call_parent(carrier: Mapping[str, Any] | None) -> Context | None:
    """The context a call's span starts in: the caller's ``traceparent``, unless the
    current span already belongs to that trace (the MCP SDK's span of the request, made
    from the same ``_meta``), which is then the closer parent; None: the current context."""
    incoming = incoming_context(carrier)
    if incoming is None:
        return None
    current = trace.get_current_span().get_span_context()
    if current.is_valid and current.trace_id == trace.get_current_span(incoming).get_span_context().trace_id:
        return None
    return incoming


def trace_id_of(parent: Context | None) -> str:
    """Without a tracer: the trace id a call joins (``parent``'s, else the current
    span's), else a new random one; 32 hex digits."""
    span_context = trace.get_current_span(parent).get_span_context()
    if span_context.is_valid:
        return trace.format_trace_id(span_context.trace_id)
    return uuid.uuid4().hex


def configure_from_env(warn: Callable[[str], None]) -> Callable[[], None] | None:
    """Set up the OpenTelemetry SDK from the standard ``OTEL_*`` environment, for
    ``runner serve``: only when the SDK is importable, no provider is set yet, and
    ``OTEL_TRACES_EXPORTER`` names exporters (``console``, ``otlp``, ...; ``none``: no
    tracing). ``console`` writes to stderr (stdout is the MCP stream under ``--stdio``).
    Returns the shutdown (flushing the spans still buffered), or None when nothing was set.
    ``warn`` hears of exporters that are not installed.
    """
    names = [name.strip() for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if not names or names == ["none"] or active_tracer() is not None:
        return None
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    except ImportError:
        warn(
            "OTEL_TRACES_EXPORTER is set but the OpenTelemetry SDK is not installed "
            "(pip install 'sandboxed-tool-runner[otel]'); no traces"
        )
        return None
    from importlib.metadata import entry_points

    exporters: list[SpanExporter] = []
    for name in names:
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            warn(f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed; it is left out")
            continue
        exporter_class = next(iter(found)).load()
        if exporter_class is ConsoleSpanExporter:
            exporters.append(ConsoleSpanExporter(out=sys.stderr))
        else:
            exporters.append(exporter_class())
    if not exporters:
        return None
    resource_env = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = bool(os.environ.get("OTEL_SERVICE_NAME")) or "service.name=" in resource_env
    attributes = {} if named else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider.shutdown
