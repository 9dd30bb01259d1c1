"""Hostile tool output: nesting that breaks a recursive parser, NaN and Infinity.

Each must be the tool's PARSE_ERROR, with its attempt audited and counted by the breaker,
never a fault of the runner, and nothing but strict JSON may come out of ``runner exec``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import ToolBench


def printing(text: str, exit_code: int = 0) -> str:
    return f"import sys\nsys.stdin.read()\nsys.stdout.write({text!r})\nsys.exit({exit_code})\n"


def events(bench: ToolBench) -> list[dict[str, Any]]:
    return [json.loads(line) for line in bench.audit_log.read_text().splitlines()]


# -- deep JSON (issue 8, item 8) ------------------------------------------------------


@pytest.mark.parametrize("levels", [990, 5000, 200])
def test_deeply_nested_json_on_stdout_is_a_parse_error_that_is_audited_and_counted(
    bench: ToolBench, levels: int
) -> None:
    bench.tool("deep", printing("[" * levels + "]" * levels))
    bench.policy["circuit_breaker"] = {"failure_threshold": 2, "reset_timeout_ms": 60000}
    runner = bench.runner()
    for _ in range(2):
        answer = runner.handle({"toolName": "deep"})
        assert answer["error"]["code"] == "PARSE_ERROR"
        assert answer["metadata"]["attempts"] == 1
    one_call = ["policy.decision", "call.attempt", "call.finished"]
    # The second failure opens the breaker, before its call's end is written.
    assert [e["event"] for e in events(bench)] == [*one_call, *one_call[:2], "breaker.opened", one_call[2]]
    assert [e["code"] for e in events(bench) if e["event"] == "call.attempt"] == ["PARSE_ERROR"] * 2
    assert runner.handle({"toolName": "deep"})["error"]["code"] == "CIRCUIT_OPEN"


def test_deep_json_from_a_failing_tool_is_its_exit_code_not_a_runner_fault(bench: ToolBench) -> None:
    bench.tool("deep", printing("[" * 990 + "]" * 990, exit_code=1))
    answer = bench.runner().handle({"toolName": "deep"})
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "exit_code"
    assert answer["metadata"]["attempts"] == 1


# -- NaN and Infinity out (issue 8, item 9) -------------------------------------------


NON_JSON_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", '{"x": [1, -1e400]}', '{"n": NaN}']


@pytest.mark.parametrize("stdout", NON_JSON_NUMBERS)
def test_a_tool_printing_nan_infinity_or_an_overflowing_number_is_a_parse_error(
    bench: ToolBench, stdout: str
) -> None:
    bench.tool("inf", printing(stdout))
    answer = bench.runner().handle({"toolName": "inf"})
    assert answer["error"]["code"] == "PARSE_ERROR"
    assert answer["metadata"]["attempts"] == 1


@pytest.mark.parametrize("stdout", ["Infinity", "1.8e308", "[1e999]"])
def test_runner_exec_never_prints_infinity(bench: ToolBench, stdout: str) -> None:
    bench.tool("inf", printing(stdout))
    bench.write_policy()

    def refuse(name: str) -> Any:
        raise AssertionError(f"runner exec printed {name}")

    config = ["--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")]
    done = subprocess.run(
        [sys.executable, "-m", "runner", *config, "exec", "inf"],
        capture_output=True,
        text=True,
        cwd=bench.root,
        timeout=60,
        env={**os.environ, "RUNNER_AUDIT_LOG": os.devnull},
    )
    assert done.returncode == 1, done.stdout
    assert json.loads(done.stdout, parse_constant=refuse)["error"]["code"] == "PARSE_ERROR"
