"""Prometheus metrics: a real ``runner serve --http ... --metrics`` process, real
MCP calls (success, denial, failure, an unknown tool, a warm one, an open breaker) and
``/metrics`` scraped during and after them; the Python API's own registry."""

from __future__ import annotations

import asyncio
import json
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator

import anyio
import httpx2
import pytest
from conftest import ToolBench, checkout
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.mcp_harness import ECHO, SLEEPER, SLOW, add_token, server_argv

from runner.telemetry import RunnerMetrics

FAILS = "import sys\nsys.stdin.read()\nsys.exit(3)\n"
# A value no label may ever show: params never become labels.
MARKER = "PARAM-VALUE-7f3a"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text page, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class MeteredServer:
    """``runner serve --http 127.0.0.1:0 --metrics 127.0.0.1:0``; both URLs once it listens."""

    def __init__(self, bench: ToolBench, metrics: str = "127.0.0.1:0") -> None:
        argv = server_argv(bench, "--http", "127.0.0.1:0", "--metrics", metrics)
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        assert self.process.stderr is not None
        urls: dict[str, str] = {}
        while len(urls) < 2:
            ready, _, _ = select.select([self.process.stderr], [], [], 30)
            assert ready, f"the server did not start: {urls}"
            line = self.process.stderr.readline()
            assert line, "the server exited"
            for what in ("MCP", "metrics"):
                if f"serving {what} at " in line:
                    urls[what] = line.split(" at ", 1)[1].strip()
        self.url, self.metrics_url = urls["MCP"], urls["metrics"]

    def scrape(self) -> Samples:
        answer = httpx2.get(self.metrics_url, timeout=10)
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain")
        return parse(answer.text)

    def scrape_text(self) -> str:
        return httpx2.get(self.metrics_url, timeout=10).text

    def stop(self) -> int:
        self.process.terminate()
        status = self.process.wait(timeout=30)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return status


@pytest.fixture
def metered(bench: ToolBench) -> Iterator[tuple[MeteredServer, str]]:
    bench.tool("echo", ECHO)
    bench.tool("warm", ECHO)
    bench.tool("sleeper", SLEEPER, limits=SLOW)
    bench.tool("fails", FAILS)
    bench.tool("secret", ECHO)
    bench.policy["roles"] = {"user": {"allow": ["echo", "warm", "sleeper", "fails"]}}
    bench.policy["tools"] = {"warm": {"pool": 1}}
    bench.policy["circuit_breaker"] = {"failure_threshold": 1, "reset_timeout_ms": 600000}
    token = add_token(bench, "agent", "user")
    server = MeteredServer(bench)
    yield server, token
    assert server.stop() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_metrics_count_calls_attempts_and_durations_by_tool_code_and_role(
    metered: tuple[MeteredServer, str],
) -> None:
    server, token = metered
    before = server.scrape()
    assert value(before, "runner_calls_in_flight") == 0
    assert value(before, "runner_breaker_open", tool="fails") == 0
    deadline = time.monotonic() + 30
    while value(server.scrape(), "runner_pool_ready", tool="warm") < 1:
        assert time.monotonic() < deadline, "the warm pool never filled"
        await anyio.sleep(0.05)
    during: Samples = {}
    async with (
        httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(60.0)
        ) as http,
        Client(streamable_http_client(server.url, http_client=http)) as client,
    ):
        for _ in range(2):
            assert not (await client.call_tool("echo", {"x": MARKER})).is_error
        assert not (await client.call_tool("warm", {"x": MARKER})).is_error
        assert (await client.call_tool("secret", {})).is_error
        assert (await client.call_tool("fails", {"x": MARKER})).is_error
        assert (await client.call_tool("fails", {})).is_error  # its breaker is open now
        assert (await client.call_tool(f"no-such-tool-{MARKER}", {})).is_error
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(client.call_tool, "sleeper", {"seconds": 1.5})
            while value(during, "runner_calls_in_flight") < 1:
                assert time.monotonic() < deadline, "the sleeper was never seen in flight"
                await anyio.sleep(0.05)
                during = await anyio.to_thread.run_sync(server.scrape)
    after = server.scrape()

    assert value(during, "runner_calls_in_flight") == 1
    assert value(during, "runner_calls_total", tool="sleeper", code="OK", role="user") == 0
    assert value(after, "runner_calls_in_flight") == 0
    expected_calls = {
        ("echo", "OK"): 2,
        ("warm", "OK"): 1,
        ("sleeper", "OK"): 1,
        ("secret", "PERMISSION_DENIED"): 1,
        ("fails", "EXECUTION_ERROR"): 1,
        ("fails", "CIRCUIT_OPEN"): 1,
        ("(unknown)", "TOOL_NOT_FOUND"): 1,
    }
    counted = {
        (dict(labels)["tool"], dict(labels)["code"]): (dict(labels)["role"], count)
        for (name, labels), count in after.items()
        if name == "runner_calls_total"
    }
    assert counted == {key: ("user", float(n)) for key, n in expected_calls.items()}
    assert value(after, "runner_attempts_total", tool="echo", reason="ok", node="local") == 2
    assert value(after, "runner_attempts_total", tool="fails", reason="exit_code", node="local") == 1
    assert value(after, "runner_attempts_total", tool="sleeper", reason="ok", node="local") == 1
    assert value(after, "runner_call_duration_seconds_count", tool="echo") == 2
    assert value(after, "runner_call_duration_seconds_count", tool="sleeper") == 1
    assert value(after, "runner_call_duration_seconds_sum", tool="sleeper") >= 1.5
    assert value(after, "runner_call_duration_seconds_bucket", tool="sleeper", le="1.0") == 0
    assert value(after, "runner_call_duration_seconds_bucket", tool="sleeper", le="+Inf") == 1
    # Cold: echo twice, fails once, sleeper once; warm: the pooled tool's one call.
    assert value(after, "runner_sandbox_start_seconds_count", backend="subprocess", warm="false") == 4
    assert value(after, "runner_sandbox_start_seconds_count", backend="subprocess", warm="true") == 1
    assert value(after, "runner_breaker_open", tool="fails") == 1
    assert value(after, "runner_breaker_open", tool="echo") == 0
    text = server.scrape_text()
    assert MARKER not in text
    assert "_created" not in text  # exactly the documented series


def test_a_runner_given_metrics_keeps_them_in_its_own_registry_not_the_global_one(bench: ToolBench) -> None:
    bench.tool("echo", ECHO)
    metrics = RunnerMetrics()
    with bench.runner(metrics=metrics) as runner:
        assert runner.call("echo", {"x": MARKER}).success
        assert runner.discover(role="user")
        runner.handle({"action": "discover", "role": "user"})
        runner.handle({"toolName": "echo", "role": "intruder"})
    samples = parse(metrics.exposition().decode())
    assert value(samples, "runner_calls_total", tool="echo", code="OK", role="user") == 1
    assert value(samples, "runner_calls_total", tool="(discover)", code="OK", role="user") == 1
    assert value(samples, "runner_calls_total", tool="echo", code="PERMISSION_DENIED", role="(unknown)") == 1
    assert value(samples, "runner_breaker_open", tool="echo") == 0
    assert b"runner_calls_total" not in generate_latest(REGISTRY)


@pytest.mark.parametrize("address", ["nope", "127.0.0.1:99999", "127.0.0.1:x"])
def test_a_bad_metrics_address_is_a_usage_error(bench: ToolBench, address: str) -> None:
    bench.tool("echo", ECHO)
    argv = server_argv(bench, "--stdio", "--metrics", address)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stderr.startswith("runner: --metrics") and "Traceback" not in done.stderr


def test_a_metrics_port_in_use_is_a_usage_error(bench: ToolBench) -> None:
    import socket

    bench.tool("echo", ECHO)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        argv = server_argv(bench, "--stdio", "--metrics", f"127.0.0.1:{port}")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert "cannot listen" in done.stderr and "Traceback" not in done.stderr


def test_serve_help_describes_the_metrics_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runner", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "--metrics HOST:PORT" in done.stdout and "/metrics" in done.stdout


def test_a_cancelled_call_is_counted_as_cancelled_and_leaves_nothing_in_flight(bench: ToolBench) -> None:
    bench.tool("sleeper", SLEEPER, limits=SLOW)
    metrics = RunnerMetrics()

    async def cancel_one() -> None:
        async with bench.runner(metrics=metrics) as runner:
            call = asyncio.ensure_future(runner.acall("sleeper", {"seconds": 30}))
            deadline = time.monotonic() + 30
            while value(parse(metrics.exposition().decode()), "runner_calls_in_flight") < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # the attempt is running
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(cancel_one())
    samples = parse(metrics.exposition().decode())
    assert value(samples, "runner_calls_total", tool="sleeper", code="CANCELLED", role="user") == 1
    assert value(samples, "runner_attempts_total", tool="sleeper", reason="cancelled", node="local") == 1
    assert value(samples, "runner_calls_in_flight") == 0


def test_an_attempt_dispatched_to_a_node_is_counted_under_that_node(bench: ToolBench) -> None:
    """A dispatched outcome's ``node`` (a Ray node) becomes the attempt's ``node`` label;
    the real dispatch is in test_dispatch_ray.py, here a backend that says where it ran."""
    from dataclasses import replace

    from support.fakes import FakeSandbox, ManualClock, failed, ok

    bench.tool("echo", ECHO)
    bench.policy["defaults"]["retries"] = 1
    outcomes = iter([replace(failed(), node="node-a"), replace(ok(), node="node-b")])
    sandbox = FakeSandbox(lambda attempt, limits: next(outcomes), ManualClock())
    metrics = RunnerMetrics()
    with bench.runner(metrics=metrics, clock=sandbox.clock, sandbox_factory=lambda name: sandbox) as runner:
        assert runner.call("echo", {}).success
    samples = parse(metrics.exposition().decode())
    assert value(samples, "runner_attempts_total", tool="echo", reason="exit_code", node="node-a") == 1
    assert value(samples, "runner_attempts_total", tool="echo", reason="ok", node="node-b") == 1


PROMQL_METRIC = re.compile(r"\b(runner_[a-z_]+)\b")
PROMQL_LABELS = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)|\{([^}]*)\}")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_grafana_dashboard_queries_only_metrics_and_labels_that_serve_exports(
    metered: tuple[MeteredServer, str],
) -> None:
    root = checkout()
    if root is None:
        pytest.skip("no checkout beside the suite (RUNNER_CHECKOUT unset): deploy/ is not in the wheel")
    dashboard = json.loads((root / "deploy" / "grafana" / "runner.json").read_text())
    server, token = metered
    async with (
        httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(60.0)
        ) as http,
        Client(streamable_http_client(server.url, http_client=http)) as client,
    ):
        assert not (await client.call_tool("echo", {"x": 1})).is_error
        assert (await client.call_tool("fails", {})).is_error
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(server.scrape_text()):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [
        v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)
    ]
    assert len(queries) >= 15
    grafana_labels = {"le", "job", "instance"}  # le: histogram buckets; job, instance: Prometheus adds them
    for query in queries:
        names = set(PROMQL_METRIC.findall(query))
        assert names, query
        assert names <= exported.keys(), (query, names - exported.keys())
        labels = {
            label.split("=")[0].strip(" !~")
            for by, selector in PROMQL_LABELS.findall(query)
            for label in (by or selector).split(",")
            if label.strip()
        }
        known = set().union(*(exported[name] for name in names)) | grafana_labels
        assert labels <= known, (query, labels - known)
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for subject in ("by tool", "by code", "by role", "p95", "breaker", "warm", "in flight"):
        assert subject in titles
