"""Metrics and traces of calls (SPEC 13): ``RunnerMetrics`` for Prometheus, OpenTelemetry spans."""

from runner.telemetry.calls import NO_TELEMETRY, CallTelemetry, Telemetry
from runner.telemetry.metrics import MetricsServer, RunnerMetrics, RunnerState

__all__ = ["NO_TELEMETRY", "CallTelemetry", "MetricsServer", "RunnerMetrics", "RunnerState", "Telemetry"]
