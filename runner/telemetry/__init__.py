"""Metrics and traces of calls: ``RunnerMetrics`` for Prometheus, OpenTelemetry spans.

``RunnerMetrics`` and ``MetricsServer`` load ``prometheus_client`` on first use: a runner
without metrics (``runner exec``) never imports it.
"""

from __future__ import annotations

import importlib

from runner.telemetry.calls import NO_TELEMETRY, CallTelemetry, Telemetry
from runner.telemetry.labels import RunnerState

TYPE_CHECKING = False
if TYPE_CHECKING:
    from runner.telemetry.listener import MetricsServer
    from runner.telemetry.metrics import RunnerMetrics

__all__ = ["NO_TELEMETRY", "CallTelemetry", "MetricsServer", "RunnerMetrics", "RunnerState", "Telemetry"]


def __getattr__(name: str) -> object:
    if name == "RunnerMetrics":
        return getattr(importlib.import_module("runner.telemetry.metrics"), name)
    if name == "MetricsServer":
        return getattr(importlib.import_module("runner.telemetry.listener"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
