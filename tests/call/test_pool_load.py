"""Warm pools under load, with real sandboxes: while the runner serves more calls than
the machine has cores, a pool starts no refill, and a call that finds its pool empty
starts cold at once instead of waiting for one; hits and misses are counted."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conftest import TRACING_TOOL, ToolBench, wait_for

from runner import Runner
from runner.telemetry import RunnerMetrics

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hardened sandbox runs as root here")

SLEEPER = "import sys, time\nsys.stdin.read()\ntime.sleep(6)\nprint(1)\n"
SLEEPER_CALL = {"toolName": "sleeper", "options": {"timeout": 20000, "deadline": 30000}}
CORES = os.cpu_count() or 1


def _attempts(bench: ToolBench) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [event for event in events if event["event"] == "call.attempt"]


def _loaded_bench(bench: ToolBench) -> None:
    bench.tool("trace", TRACING_TOOL)
    bench.tool("sleeper", SLEEPER)
    bench.policy["tools"] = {"trace": {"pool": 1}}


def _load(runner: Runner, callers: ThreadPoolExecutor) -> list[Any]:
    """One call more than the cores, each of the unpooled sleeper (6 s), in flight."""
    calls = [callers.submit(runner.handle, SLEEPER_CALL) for _ in range(CORES + 1)]
    wait_for(runner._pools._loaded, 10.0)
    return calls


def test_a_loaded_runner_starts_no_refill_and_refills_once_the_load_is_gone(bench: ToolBench) -> None:
    _loaded_bench(bench)
    with bench.runner() as runner, ThreadPoolExecutor(CORES + 1) as callers:
        wait_for(lambda: runner.warm_sandboxes()["trace"] == 1)
        load = _load(runner, callers)
        assert runner.handle({"toolName": "trace", "params": {"n": 1}})["success"]  # takes the warm one
        # Unloaded, its replacement would start at once and be ready within ~50 ms.
        time.sleep(1.5)
        held_back = runner.warm_sandboxes()["trace"]
        still_loaded = not any(call.done() for call in load)
        assert all(call.result(timeout=60)["success"] for call in load)
        wait_for(lambda: runner.warm_sandboxes()["trace"] == 1, 10.0)  # the load is gone: refilled
    assert still_loaded, "the load ended before the pool was looked at: the machine is too slow for this test"
    assert held_back == 0


def test_a_call_that_finds_its_pool_empty_starts_cold_at_once(bench: ToolBench) -> None:
    # Under load no refill comes until the load is gone (6 s): a call that waited for one
    # would end after the sleepers; one started cold ends long before them.
    _loaded_bench(bench)
    metrics = RunnerMetrics()
    with bench.runner(metrics=metrics) as runner, ThreadPoolExecutor(CORES + 1) as callers:
        wait_for(lambda: runner.warm_sandboxes()["trace"] == 1)
        load = _load(runner, callers)
        first = runner.handle({"toolName": "trace", "params": {"n": 1}})
        second = runner.handle({"toolName": "trace", "params": {"n": 2}})
        second_done_under_load = not any(call.done() for call in load)
        assert all(call.result(timeout=60)["success"] for call in load)
        exposition = metrics.exposition().decode()
    assert first["success"] and second["success"], (first, second)
    assert second_done_under_load, "the empty pool's call waited for the load to end"
    trace = [event for event in _attempts(bench) if event["toolName"] == "trace"]
    assert [(event["warm"], event.get("pooled")) for event in trace] == [(True, True), (False, True)]
    sleeper = [event for event in _attempts(bench) if event["toolName"] == "sleeper"]
    assert all("pooled" not in event for event in sleeper)  # not pooled: no hit, no miss
    assert 'runner_pool_takes_total{result="hit",tool="trace"} 1.0' in exposition
    assert 'runner_pool_takes_total{result="miss",tool="trace"} 1.0' in exposition
    assert 'tool="sleeper"' not in exposition.split("runner_pool_takes")[-1]
