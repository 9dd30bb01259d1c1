"""Each call's metrics and spans, fed from the call path by a handful of hooks.

``Telemetry.call`` wraps a whole call: the in-flight gauge, the ``runner.call`` span
(current while the call runs, so that the attempts, and whatever the host instruments
inside, nest under it) and the call's trace id. The ``CallTelemetry`` it yields travels
in the call's ``CallContext``; the executor tells it when each attempt starts and ends,
the runner when the call ends. With neither metrics nor a tracer, every hook returns at
once and no span is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from runner.call.hooks import CANCELLED
from runner.telemetry.labels import (
    ATTEMPT_CANCELLED,
    LOCAL_NODE,
    OK,
    attempt_reason,
    role_label,
    tool_label,
)
from runner.telemetry.tracing import active_tracer, call_parent, trace_id_of
from sandboxes import LaunchSpec, Limits, PreparedSandbox, Sandbox

if TYPE_CHECKING:
    from runner.telemetry.metrics import RunnerMetrics  # prometheus_client: only with metrics

CALL_SPAN = "runner.call"
ATTEMPT_SPAN = "runner.attempt"
DISCOVER = "(discover)"  # the tool label of a discovery request


class Telemetry:
    """A runner's metrics (optional) and tracing; ``known_tool`` and ``known_role`` say
    which names may be labels (the registry's and the policy's, as they are now)."""

    def __init__(
        self,
        metrics: RunnerMetrics | None,
        known_tool: Callable[[str], bool],
        known_role: Callable[[str], bool],
    ) -> None:
        self.metrics = metrics
        self.known_tool = known_tool
        self.known_role = known_role

    @contextmanager
    def call(self, request: object) -> Iterator[CallTelemetry]:
        """One call, from receipt to answer; its span (with a tracer) is current inside.

        ``request`` is the raw request: its ``metadata.traceparent``, when valid, is the
        span's parent.
        """
        metadata = request.get("metadata") if isinstance(request, dict) else None
        parent = call_parent(metadata) if isinstance(metadata, dict) else None
        metrics = self.metrics
        if metrics is not None:
            metrics.in_flight.inc()
        try:
            tracer = active_tracer()
            if tracer is None:
                yield CallTelemetry(self, None, None, trace_id_of(parent))
                return
            span = tracer.start_span(CALL_SPAN, context=parent)
            inside = trace.set_span_in_context(span, parent)
            # Current while the call runs (not ``use_span``: a generator less per call);
            # its status and attributes are set by ``finished``.
            token = otel_context.attach(inside)
            try:
                trace_id = trace.format_trace_id(span.get_span_context().trace_id)
                yield CallTelemetry(self, tracer, span, trace_id, inside)
            finally:
                otel_context.detach(token)
                span.end()
        finally:
            if metrics is not None:
                metrics.in_flight.dec()


class CallTelemetry:
    """One call's hooks. ``trace_id`` is its W3C trace id (32 hex digits)."""

    def __init__(
        self,
        owner: Telemetry | None,
        tracer: Tracer | None,
        span: Span | None,
        trace_id: str,
        inside: Context | None = None,
    ) -> None:
        self.trace_id = trace_id
        self._tracer = tracer
        self._inside = inside  # the context with the call's span: the attempts' parent
        self._owner = owner
        self._metrics = owner.metrics if owner is not None else None
        self._span = span
        self._active = self._metrics is not None or span is not None
        self._discovery = False
        self._attempt_span: Span | None = None
        self._tool = ""
        self._backend = ""
        self._prepare_s: float | None = None

    def timed(self, sandbox: Sandbox) -> Sandbox:
        """``sandbox``, its ``prepare`` timed for ``runner_sandbox_start_seconds``."""
        return _TimedSandbox(sandbox, self) if self._active else sandbox

    def discovering(self) -> None:
        """The request is a discovery, not a call of a tool."""
        self._discovery = True

    def attempt_started(self, tool: str, backend: str) -> None:
        if not self._active:
            return
        self._tool, self._backend, self._prepare_s = tool, backend, None
        if self._tracer is not None:  # its attributes are set once, at its end: each costs
            self._attempt_span = self._tracer.start_span(ATTEMPT_SPAN, context=self._inside)

    def prepared(self, seconds: float) -> None:
        self._prepare_s = seconds

    def attempt_ended(self, fields: Mapping[str, Any]) -> None:
        """The attempt's end, from the fields of its ``call.attempt`` audit event."""
        if not self._active:
            return
        code = fields.get("code")
        given = fields.get("reason")
        if fields.get("cancelled") is True:
            reason = ATTEMPT_CANCELLED
        elif isinstance(given, str):
            reason = attempt_reason(given)
        else:  # a failure without a reason of its own (PARSE_ERROR) is named by its code
            reason = attempt_reason(code.lower() if isinstance(code, str) else None)
        warm = fields.get("warm") is True
        if self._metrics is not None:
            node = fields.get("node")
            self._metrics.count_attempt(self._tool, reason, node if isinstance(node, str) else LOCAL_NODE)
            if self._prepare_s is not None and reason != ATTEMPT_CANCELLED:
                self._metrics.observe_start(self._backend, warm, self._prepare_s)
        span, self._attempt_span = self._attempt_span, None
        if span is not None:
            span.set_attributes({"backend": self._backend, "warm": warm, "reason": reason})
            if isinstance(code, str) or reason == ATTEMPT_CANCELLED:
                span.set_status(Status(StatusCode.ERROR, code if isinstance(code, str) else CANCELLED))
            span.end()

    def finished(
        self,
        tool_name: str | None,
        role: str | None,
        code: str | None,
        attempts: int,
        seconds: float,
    ) -> None:
        """The call's answer (``code`` None: success), or ``CANCELLED``."""
        if not self._active or self._owner is None:
            return
        code = code or OK
        if self._metrics is not None:
            owner = self._owner
            tool = DISCOVER if self._discovery else tool_label(tool_name, owner.known_tool)
            self._metrics.count_call(tool, code, role_label(role, owner.known_role), seconds)
        span = self._span
        if span is not None:
            attributes: dict[str, Any] = {"code": code, "attempts": attempts}
            if tool_name is not None:
                attributes["tool"] = tool_name
            if role is not None:
                attributes["role"] = role
            span.set_attributes(attributes)
            if code != OK:
                span.set_status(Status(StatusCode.ERROR, code))


# The hooks of a call made without a runner's telemetry (the executor's own tests).
NO_TELEMETRY = CallTelemetry(None, None, None, "0" * 32)


class _TimedSandbox:
    """A backend whose ``prepare`` tells the call how long it took; all else is the backend's."""

    def __init__(self, sandbox: Sandbox, call: CallTelemetry) -> None:
        self.name = sandbox.name
        self._sandbox = sandbox
        self._call = call

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        started = time.perf_counter()
        prepared = await self._sandbox.prepare(spec, limits)
        self._call.prepared(time.perf_counter() - started)
        return prepared

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sandbox, name)  # optional capabilities of the backend stay visible
