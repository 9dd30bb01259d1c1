"""The guard's own cost per call, without and with metrics and tracing (issue 15:
metrics may add at most 50 us per call; tracing costs nothing without the SDK).

    python3 bench/guard_overhead.py [--calls 500] [--rounds 15]

The tool runs in an instant in-memory backend (prepare and run return at once), so what
is timed is the runner alone: request validation, policy, params, breaker, attempts,
output parsing, audit events (to /dev/null). Rows, all in this one process and
interleaved round by round so that drift hits each alike:

- baseline: no metrics, no tracer provider (the API's no-op: no span is made)
- metrics: a ``RunnerMetrics`` given to the runner
- tracing: the OpenTelemetry SDK's provider, spans recorded and handed to a batch
  processor whose exporter drops them (the cost of recording, not of a network)
- metrics + tracing

Each row is the median over rounds of the mean time per ``await runner.acall(...)``, and
the least round (the machine is shared: the least is the one the others disturbed least).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from opentelemetry import trace  # noqa: E402

from runner import Runner  # noqa: E402
from runner.telemetry import RunnerMetrics  # noqa: E402
from sandboxes import LaunchSpec, Limits, SandboxOutcome  # noqa: E402

# Issue 15: metrics on the call path may add at most this per call. Tracing's promise is
# another: no cost without the SDK (the baseline row has no SDK provider); with a
# recording SDK, the cost is the SDK's own span creation, reported here as measured.
BUDGET_US = 50.0
PARAMS = {"a": 1, "b": 2}
MANIFEST = (
    "name: add\ndescription: add\ncommand: [python3, main.py]\nsandbox: instant\n"
    "parameters: {type: object, properties: {a: {type: number}, b: {type: number}}, required: [a, b]}\n"
)
POLICY = "version: 1\ndefault_role: u\nwhitelist: ['*']\nroles: {u: {allow: ['*']}}\n"
ANSWER = SandboxOutcome(exit_code=0, signal=None, stdout=b"3", stderr_tail="", duration_ms=0.0)


class InstantSandbox:
    """A backend whose sandboxes cost nothing: the runner's own work is all that is left."""

    name = "instant"

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> InstantPrepared:
        return InstantPrepared()


class InstantPrepared:
    async def run(self, payload: bytes) -> SandboxOutcome:
        return ANSWER

    async def close(self) -> None:
        pass


def tracer_provider() -> trace.TracerProvider:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropping(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropping()))
    return provider


def use_provider(provider: trace.TracerProvider | None) -> None:
    # The API allows setting its global provider once per process; the rows switch it
    # back and forth, as the OpenTelemetry project's own test utilities do.
    trace._TRACER_PROVIDER = provider  # type: ignore[attr-defined]


async def per_call_us(runner: Runner, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        result = await runner.acall("add", PARAMS)
        if not result.success:
            raise SystemExit(f"the call failed: {result.error}")
    return (time.perf_counter() - started) / calls * 1e6


async def main(calls: int, rounds: int) -> int:
    root = Path(tempfile.mkdtemp(prefix="runner-guard-"))
    (root / "tools" / "add").mkdir(parents=True)
    (root / "tools" / "add" / "tool.yaml").write_text(MANIFEST)
    (root / "tools" / "add" / "main.py").write_text("")
    (root / "policies.yaml").write_text(POLICY)
    instant = InstantSandbox()
    sdk = tracer_provider()
    rows = {
        "baseline": (None, None),
        "metrics": (RunnerMetrics(), None),
        "tracing": (None, sdk),
        "metrics + tracing": (RunnerMetrics(), sdk),
    }
    runners = {
        name: Runner.load(
            tools=root / "tools",
            policies=root / "policies.yaml",
            audit_log=os.devnull,
            sandbox_factory=lambda _name: instant,
            warm_pools=False,
            metrics=metrics,
        )
        for name, (metrics, _) in rows.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(rounds + 1):
        for name, (_, provider) in rows.items():
            use_provider(provider)
            measured = await per_call_us(runners[name], calls)
            if round_ > 0:  # the first round warms every path up
                samples[name].append(measured)
    use_provider(None)
    for runner in runners.values():
        await runner.aclose()
    sdk.shutdown()  # type: ignore[attr-defined]

    base = statistics.median(samples["baseline"])
    least = min(samples["baseline"])
    print(f"guard overhead per call ({calls} calls x {rounds} rounds, instant backend)")
    print(f"  {'':<18} {'median':>8}  {'added':>7}  {'least':>8}  {'added':>7}")
    for name, values in samples.items():
        median, low = statistics.median(values), min(values)
        print(f"  {name:<18} {median:8.1f}  {median - base:+7.1f}  {low:8.1f}  {low - least:+7.1f}   us/call")
    added = statistics.median(samples["metrics"]) - base
    verdict = "holds" if added <= BUDGET_US else "DOES NOT hold"
    print(f"metrics add {added:.1f} us per call (median): the {BUDGET_US:.0f} us budget {verdict}")
    traced = statistics.median(samples["tracing"]) - base
    print(f"a recording OpenTelemetry SDK adds {traced:.1f} us per call (two spans; sample to lower it)")
    return 0 if added <= BUDGET_US else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.calls, args.rounds)))
