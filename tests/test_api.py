"""The Python API: typed results, never raising from handle, concurrent calls."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ToolBench

from runner import CallError, Runner

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
SLOW_ECHO = (
    "import json, sys, time\np = json.load(sys.stdin)['params']\ntime.sleep(0.3)\njson.dump(p, sys.stdout)\n"
)


def test_call_returns_a_typed_result(shipped: Runner) -> None:
    result = shipped.call("add_numbers", {"a": 1, "b": 2}, role="user", timeout=2000)
    assert result.success is True
    assert result.result == 3
    assert result.error is None
    assert result.metadata.attempts == 1
    failed = shipped.call("add_numbers", {"a": 1})
    assert failed.error is not None
    assert failed.error.code == "INVALID_PARAMS"


def test_acall_and_discover(shipped: Runner) -> None:
    result = asyncio.run(shipped.acall("add_numbers", {"a": 2, "b": 2}))
    assert result.result == 4
    assert [t["name"] for t in shipped.discover(filter="math", role="user")] == ["add_numbers"]
    with pytest.raises(CallError):
        shipped.discover(role="ghost")


@pytest.mark.parametrize(
    "request_",
    [
        None,
        42,
        "text",
        [],
        {},
        {"toolName": 5},
        {"toolName": "x", "params": []},
        {"toolName": "x", "options": {"timeout": -1}},
        {"toolName": "x", "options": {"format": "xml"}},
        {"toolName": "x", "surprise": 1},
        {"action": "explode"},
        {"toolName": "a" * 10000},
    ],
)
def test_handle_never_raises_and_answers_invalid_requests(shipped: Runner, request_: object) -> None:
    answer = shipped.handle(request_)
    assert answer["success"] is False
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert set(answer) == {"success", "result", "error", "metadata"}


def test_dozens_of_overlapping_async_calls_through_one_runner(bench: ToolBench, no_survivors) -> None:
    bench.tool("slow_echo", SLOW_ECHO)
    runner = bench.runner()

    async def many() -> list:
        return await asyncio.gather(
            *(runner.acall("slow_echo", {"i": i}, request_id=f"req_async_{i}") for i in range(40))
        )

    results = asyncio.run(many())
    assert [r.result for r in results] == [{"i": i} for i in range(40)]
    for i in range(40):
        no_survivors(f"req_async_{i}")


def test_overlapping_calls_from_threads_share_one_runner(bench: ToolBench) -> None:
    bench.tool("slow_echo", SLOW_ECHO)
    runner = bench.runner()
    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda i: runner.call("slow_echo", {"i": i}), range(24)))
    assert [r.result for r in results] == [{"i": i} for i in range(24)]
