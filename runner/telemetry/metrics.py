"""The runner's Prometheus metrics, in a registry of its own.

A ``RunnerMetrics`` holds the series and the ``CollectorRegistry`` they live in; never
prometheus_client's global ``REGISTRY``, so a host application's metrics and the
runner's are not mixed (the host may register ``metrics.registry``'s collectors in its
own exposition if it wants them side by side). Counters and histograms are updated on
the call path (a dict lookup and a lock each); the state series (breaker, pool ready,
pool takes) are read from the runner only when scraped.

Every label value is bounded: tools come from the registry (an unknown name is
``UNKNOWN``), roles from the policy (an unknown one ``UNKNOWN``, none ``NO_ROLE``), codes
from the error table, reasons from the sandbox's stop reasons. Nothing from a request's
params ever becomes a label.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from runner.call.hooks import CANCELLED
from runner.telemetry.labels import (
    ATTEMPT_CANCELLED,
    ATTEMPT_OK,
    ATTEMPT_REASONS,
    LOCAL_NODE,
    NO_ROLE,
    OK,
    OTHER_REASON,
    UNKNOWN,
    RunnerState,
    attempt_reason,
    role_label,
    tool_label,
)

__all__ = [
    "ATTEMPT_CANCELLED",
    "ATTEMPT_OK",
    "ATTEMPT_REASONS",
    "CANCELLED",
    "LOCAL_NODE",
    "NO_ROLE",
    "OK",
    "OTHER_REASON",
    "UNKNOWN",
    "RunnerMetrics",
    "RunnerState",
    "attempt_reason",
    "role_label",
    "tool_label",
]

# A call is a sandbox start plus the tool's own work: from a few ms to the longest timeouts.
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# A warm sandbox is taken in microseconds, a cold one prepared in milliseconds to seconds.
START_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


StateSource = Callable[[], RunnerState]
_Children = dict[tuple[object, tuple[str, ...]], Any]  # (series, label values) -> its child


class _StateCollector(Collector):
    """``runner_breaker_open``, ``runner_pool_ready`` and ``runner_pool_takes``, read from
    the runners at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: list[StateSource] = []

    def add(self, source: StateSource) -> None:
        with self._lock:
            self._sources.append(source)

    def remove(self, source: StateSource) -> None:
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def describe(self) -> Iterable[Metric]:
        return self._families(RunnerState())

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            sources = list(self._sources)
        total = RunnerState()
        for source in sources:  # several runners on one registry: one sample per tool
            state = source()
            for tool, is_open in state.breakers.items():
                total.breakers[tool] = total.breakers.get(tool, False) or is_open
            for tool, ready in state.pools.items():
                total.pools[tool] = total.pools.get(tool, 0) + ready
            for tool, (hits, misses) in state.takes.items():
                before = total.takes.get(tool, (0, 0))
                total.takes[tool] = (before[0] + hits, before[1] + misses)
        return self._families(total)

    @staticmethod
    def _families(state: RunnerState) -> Iterator[Metric]:
        breaker = GaugeMetricFamily(
            "runner_breaker_open", "1 while the tool's circuit breaker is open or half-open", labels=["tool"]
        )
        for tool, is_open in sorted(state.breakers.items()):
            breaker.add_metric([tool], 1.0 if is_open else 0.0)
        ready = GaugeMetricFamily("runner_pool_ready", "Warm sandboxes ready for the tool", labels=["tool"])
        for tool, count in sorted(state.pools.items()):
            ready.add_metric([tool], float(count))
        takes = CounterMetricFamily(
            "runner_pool_takes",
            "Calls of a pooled tool that took a warm sandbox (hit) or started cold (miss)",
            labels=["tool", "result"],
        )
        for tool, (hits, misses) in sorted(state.takes.items()):
            takes.add_metric([tool, "hit"], float(hits))
            takes.add_metric([tool, "miss"], float(misses))
        yield breaker
        yield ready
        yield takes


class RunnerMetrics:
    """The series of docs/observability.md in ``registry`` (a new ``CollectorRegistry`` by default).

    Give one to ``Runner.load(metrics=...)``; read it with ``exposition()`` or serve it
    with ``runner serve --metrics``. One may serve several runners (their counts add up).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        own = self.registry
        self.calls = Counter(
            "runner_calls",
            "Calls answered, by tool, answer code and role",
            ("tool", "code", "role"),
            registry=own,
        )
        self.attempts = Counter(
            "runner_attempts",
            "Attempts made, by tool, how they ended and the node they ran on",
            ("tool", "reason", "node"),
            registry=own,
        )
        self.call_duration = Histogram(
            "runner_call_duration_seconds",
            "From a call's receipt to its answer",
            ("tool",),
            buckets=CALL_BUCKETS,
            registry=own,
        )
        self.sandbox_start = Histogram(
            "runner_sandbox_start_seconds",
            "Making a sandbox ready for its payload: prepared cold, or taken warm from a pool",
            ("backend", "warm"),
            buckets=START_BUCKETS,
            registry=own,
        )
        self.in_flight = Gauge("runner_calls_in_flight", "Calls being served now", registry=own)
        self._state = _StateCollector()
        own.register(self._state)
        # Each series' child by label values: ``labels()`` validates and locks on every
        # call, a dict lookup does not (the label values are bounded, and so is this).
        self._children: _Children = {}

    def count_call(self, tool: str, code: str, role: str, seconds: float) -> None:
        """One answered call; ``tool`` and ``role`` must already be bounded label values
        (``tool_label``, ``role_label``)."""
        _child(self.calls, self._children, (tool, code, role)).inc()
        _child(self.call_duration, self._children, (tool,)).observe(seconds)

    def count_attempt(self, tool: str, reason: str | None, node: str = LOCAL_NODE) -> None:
        """One attempt's end; ``reason`` None: it succeeded. ``node``: the Ray node of a
        dispatched attempt, ``local`` for one run on this host."""
        _child(self.attempts, self._children, (tool, attempt_reason(reason), node)).inc()

    def observe_start(self, backend: str, warm: bool, seconds: float) -> None:
        _child(self.sandbox_start, self._children, (backend, "true" if warm else "false")).observe(seconds)

    def watch(self, source: StateSource) -> None:
        """Show ``source``'s breakers and pools in the state gauges from now on."""
        self._state.add(source)

    def unwatch(self, source: StateSource) -> None:
        self._state.remove(source)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


def _child(
    metric: MetricWrapperBase, cache: dict[tuple[object, tuple[str, ...]], Any], key: tuple[str, ...]
) -> Any:
    """``metric.labels(*key)``, found once."""
    child = cache.get((metric, key))
    if child is None:
        child = cache[(metric, key)] = metric.labels(*key)
    return child
