"""Hostile tools against the subprocess sandbox: each tries to outlive, flood or exhaust.

After every call, ``/proc`` is scanned for any process carrying the call's REQUEST_ID.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conftest import HOARDING_CHILDREN, SPINNING_CHILDREN, ToolBench

IGNORE_SIGTERM_AND_DAEMONIZE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stdin.read()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    os._exit(0)
time.sleep(120)
"""

CHILD_HOLDS_STDOUT = """
import json, os, sys, time
sys.stdin.read()
if os.fork() == 0:
    os.setsid()
    time.sleep(120)  # still holds stdout and stderr
    os._exit(0)
json.dump({"done": True}, sys.stdout)
sys.stdout.flush()
"""

FLOOD_STDOUT = """
import sys
chunk = "x" * 65536
while True:
    sys.stdout.write(chunk)
"""

FLOOD_STDERR = """
import json, sys
sys.stdin.read()
chunk = "e" * 65536
for _ in range(800):  # 50 MiB
    sys.stderr.write(chunk)
sys.stderr.write("LAST-LINE")
json.dump({"ok": True}, sys.stdout)
"""

NEVER_READS_STDIN = """
import json, sys, time
json.dump({"ignored": "input"}, sys.stdout)
sys.stdout.flush()
time.sleep(0.3)
"""

ALLOCATE = """
import json, sys
sys.stdin.read()
blocks = []
for _ in range(1024):
    blocks.append(bytearray(16 * 1024 * 1024))
json.dump(len(blocks), sys.stdout)
"""

SPIN = """
import sys
sys.stdin.read()
while True:
    pass
"""


def call(bench: ToolBench, tool: str, request_id: str, **options: object) -> dict[str, Any]:
    return bench.runner().handle(
        {"toolName": tool, "requestId": request_id, "options": {"retries": 0, **options}}
    )


def test_a_tool_that_ignores_sigterm_and_leaves_a_setsid_grandchild_is_killed_on_time(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("stubborn", IGNORE_SIGTERM_AND_DAEMONIZE)
    started = time.monotonic()
    answer = call(bench, "stubborn", "req_stubborn", timeout=500)
    assert answer["error"]["code"] == "TIMEOUT"
    assert time.monotonic() - started < 3.0
    no_survivors("req_stubborn")


def test_a_child_holding_stdout_neither_delays_the_answer_nor_survives(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("holder", CHILD_HOLDS_STDOUT)
    started = time.monotonic()
    answer = call(bench, "holder", "req_holder", timeout=5000)
    assert answer["success"] is True
    assert answer["result"] == {"done": True}
    assert time.monotonic() - started < 3.0
    no_survivors("req_holder")


def test_a_stdout_flood_is_cut_at_the_output_limit(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("flood", FLOOD_STDOUT, limits={"max_output_bytes": 100_000})
    answer = call(bench, "flood", "req_flood")
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "output_limit"
    no_survivors("req_flood")


def test_a_stderr_flood_is_kept_as_a_bounded_tail(bench: ToolBench) -> None:
    bench.tool("noisy", FLOOD_STDERR, limits={"timeout_ms": 20000})
    bench.tool(
        "noisy_fail",
        FLOOD_STDERR.replace("json.dump", "sys.exit(2); json.dump"),
        limits={"timeout_ms": 20000},
    )
    runner = bench.runner()
    assert runner.handle({"toolName": "noisy"})["result"] == {"ok": True}
    failed = runner.handle({"toolName": "noisy_fail", "options": {"retries": 0}})
    stderr = failed["error"]["details"]["stderr"]
    assert stderr.endswith("LAST-LINE")
    assert len(stderr) <= 4096


def test_a_tool_that_never_reads_a_large_stdin_still_answers(bench: ToolBench) -> None:
    bench.tool("deaf", NEVER_READS_STDIN)
    answer = bench.runner().handle(
        {"toolName": "deaf", "params": {"blob": "z" * 4_000_000}, "options": {"retries": 0}}
    )
    assert answer["success"] is True
    assert answer["result"] == {"ignored": "input"}


def test_allocating_past_the_memory_limit_is_a_memory_limit_kill(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("hog", ALLOCATE, limits={"memory_mb": 64})
    answer = call(bench, "hog", "req_hog")
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "memory_limit"
    no_survivors("req_hog")


def test_spinning_past_the_cpu_limit_is_a_cpu_limit_kill(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("spinner", SPIN, limits={"cpu_seconds": 1, "timeout_ms": 10000})
    started = time.monotonic()
    answer = call(bench, "spinner", "req_spin")
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "cpu_limit"
    assert time.monotonic() - started < 5.0
    no_survivors("req_spin")


def test_eight_spinning_children_are_stopped_at_the_cpu_budget_of_the_whole_tool(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    # Each child stays far below the per-process CPU limit (a quarter of the budget at
    # most): only the cgroup's total, polled by the runner, can stop them.
    bench.tool("spinners", SPINNING_CHILDREN, limits={"cpu_seconds": 2, "timeout_ms": 20000})
    started = time.monotonic()
    answer = call(bench, "spinners", "req_spinners")
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "cpu_limit"
    assert time.monotonic() - started < 8  # 2 CPU-seconds take ~1 s on two cores
    no_survivors("req_spinners")


def test_a_child_killed_for_memory_while_its_parent_waits_ends_the_call_with_memory_limit(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("hog_children", HOARDING_CHILDREN, limits={"memory_mb": 64, "timeout_ms": 10000})
    started = time.monotonic()
    answer = call(bench, "hog_children", "req_hog_children")
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "memory_limit"
    assert time.monotonic() - started < 6
    no_survivors("req_hog_children")


def test_two_hundred_sequential_calls_of_a_healthy_tool_succeed(bench: ToolBench) -> None:
    bench.tool("ok", "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n")
    runner = bench.runner()
    successes = sum(
        runner.handle({"toolName": "ok", "params": {"i": i}})["result"] == {"i": i} for i in range(200)
    )
    assert successes >= 198  # the acceptance bar is 99%; we expect all 200
