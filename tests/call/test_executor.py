"""Retries, deadline, the final-code rule and the circuit breaker, on a fake backend."""

from __future__ import annotations

import pytest
from conftest import ToolBench
from support.fakes import FakeSandbox, ManualClock, Script, failed, ok, timed_out

from runner import Runner
from runner.call.breaker import CircuitOpen


def runner_with(
    bench: ToolBench, script: Script, clock: ManualClock | None = None
) -> tuple[Runner, FakeSandbox]:
    clock = clock or ManualClock()
    bench.tool("t", "")
    sandbox = FakeSandbox(script, clock)
    return bench.runner(clock=clock, sandbox_factory=lambda name: sandbox), sandbox


def test_retries_wait_the_retry_delay_between_attempts(bench: ToolBench) -> None:
    clock = ManualClock()
    runner, sandbox = runner_with(bench, lambda n, _: ok() if n == 3 else failed(), clock)
    answer = runner.handle({"toolName": "t", "options": {"retries": 3, "retryDelay": 250}})
    assert answer["success"] is True
    assert answer["metadata"]["attempts"] == 3
    assert clock.sleeps == [0.25, 0.25]
    assert sandbox.closed == 3  # every attempt's sandbox is torn down


def test_one_failed_attempt_keeps_its_own_code(bench: ToolBench) -> None:
    runner, _ = runner_with(bench, lambda n, _: failed(7))
    answer = runner.handle({"toolName": "t", "options": {"retries": 0}})
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["exitCode"] == 7
    assert answer["metadata"]["attempts"] == 1


def test_several_attempts_ending_in_a_timeout_are_a_timeout(bench: ToolBench) -> None:
    runner, _ = runner_with(bench, lambda n, _: failed() if n == 1 else timed_out())
    answer = runner.handle(
        {"toolName": "t", "options": {"retries": 1, "retryDelay": 0, "timeout": 100, "deadline": 60000}}
    )
    assert answer["error"]["code"] == "TIMEOUT"
    assert answer["metadata"]["attempts"] == 2


def test_several_attempts_ending_in_a_failure_are_retry_exhausted(bench: ToolBench) -> None:
    runner, _ = runner_with(bench, lambda n, _: timed_out() if n == 1 else failed(4))
    answer = runner.handle(
        {"toolName": "t", "options": {"retries": 2, "retryDelay": 0, "timeout": 100, "deadline": 60000}}
    )
    assert answer["error"]["code"] == "RETRY_EXHAUSTED"
    assert answer["error"]["details"]["lastError"]["details"]["exitCode"] == 4
    assert answer["metadata"]["attempts"] == 3


def test_the_deadline_cuts_the_last_attempt_and_starts_no_retry_it_cannot_fit(bench: ToolBench) -> None:
    clock = ManualClock()
    runner, sandbox = runner_with(bench, lambda n, _: timed_out(), clock)
    start = clock.now
    answer = runner.handle(
        {"toolName": "t", "options": {"timeout": 2000, "retries": 5, "retryDelay": 500, "deadline": 5000}}
    )
    assert answer["error"]["code"] == "TIMEOUT"
    # 2000 + 500 + 2000 + 500 = 5000: the third attempt could not start.
    assert [limits.timeout_ms for limits in sandbox.runs] == [2000, 2000]
    assert answer["metadata"]["attempts"] == 2
    assert clock.now - start <= 5.0 + 1e-6


def test_an_attempt_never_outlives_the_deadline(bench: ToolBench) -> None:
    runner, sandbox = runner_with(bench, lambda n, _: timed_out())
    answer = runner.handle(
        {"toolName": "t", "options": {"timeout": 3000, "retries": 3, "retryDelay": 0, "deadline": 4000}}
    )
    assert [limits.timeout_ms for limits in sandbox.runs] == [3000, 1000]
    assert answer["error"]["code"] == "TIMEOUT"
    assert answer["error"]["details"]["deadline"] is True


def test_parse_errors_and_sandbox_unavailable_are_not_retried(bench: ToolBench) -> None:
    runner, sandbox = runner_with(bench, lambda n, _: ok(b"not json"))
    answer = runner.handle({"toolName": "t", "options": {"retries": 3}})
    assert answer["error"]["code"] == "PARSE_ERROR"
    assert len(sandbox.runs) == 1


def test_the_breaker_opens_after_the_threshold_and_answers_circuit_open(bench: ToolBench) -> None:
    bench.policy["circuit_breaker"] = {"failure_threshold": 2, "reset_timeout_ms": 10000}
    clock = ManualClock()
    runner, sandbox = runner_with(bench, lambda n, _: failed(), clock)
    for _ in range(2):
        assert runner.handle({"toolName": "t"})["error"]["code"] == "EXECUTION_ERROR"
    answer = runner.handle({"toolName": "t"})
    assert answer["error"]["code"] == "CIRCUIT_OPEN"
    assert answer["error"]["retryable"] is True
    assert answer["metadata"]["attempts"] == 0
    assert len(sandbox.runs) == 2


def test_a_half_open_breaker_lets_exactly_one_probe_through(bench: ToolBench) -> None:
    bench.policy["circuit_breaker"] = {"failure_threshold": 1, "reset_timeout_ms": 10000}
    clock = ManualClock()
    outcomes = {"next": failed()}
    runner, _ = runner_with(bench, lambda n, _: outcomes["next"], clock)
    breaker_tool = {"toolName": "t"}
    assert runner.handle(breaker_tool)["error"]["code"] == "EXECUTION_ERROR"
    assert runner.handle(breaker_tool)["error"]["code"] == "CIRCUIT_OPEN"
    clock.now += 10.0
    breaker = runner._guard.breaker("t", runner.policy)
    with breaker.guard(ends_by=clock.now + 5) as probe:  # the probe
        with pytest.raises(CircuitOpen):  # everyone else waits for it
            breaker.guard(ends_by=clock.now + 5).__enter__()
        probe.record(True)
    outcomes["next"] = ok()
    assert runner.handle(breaker_tool)["success"] is True


def test_a_failed_probe_opens_the_breaker_again(bench: ToolBench) -> None:
    bench.policy["circuit_breaker"] = {"failure_threshold": 1, "reset_timeout_ms": 1000}
    clock = ManualClock()
    runner, sandbox = runner_with(bench, lambda n, _: failed(), clock)
    runner.handle({"toolName": "t"})
    clock.now += 1.0
    assert runner.handle({"toolName": "t"})["error"]["code"] == "EXECUTION_ERROR"  # the probe
    assert runner.handle({"toolName": "t"})["error"]["code"] == "CIRCUIT_OPEN"
    assert len(sandbox.runs) == 2
