"""The Python API: typed results, never raising from handle, concurrent calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conftest import ToolBench

from runner import CallError, Runner
from runner.call.answers import CallResult

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


def test_dozens_of_overlapping_async_calls_through_one_runner(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("slow_echo", SLOW_ECHO)
    runner = bench.runner()

    async def many() -> list[CallResult]:
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


@pytest.mark.parametrize(
    "request_",
    [
        {"toolName": "add_numbers", "params": {"a": 1, "b": 2}, "requestId": "a\u0000b"},
        {"toolName": "add_numbers", "params": {"a": 1, "b": 2}, "requestId": "a\nb"},
        {"toolName": "add_numbers", "params": {"a": "\ud800", "b": 2}},
        {"toolName": "add_numbers", "params": {"a": 1, "b": 2}, "options": {"timeout": True}},
        {"toolName": "add_numbers", "params": {"a": 1, "b": 2}, "options": {"retries": "3"}},
        {"toolName": "add_numbers", "params": {"a": 1, "b": 2}, "options": {"deadline": 10**400}},
        {"toolName": "add_numbers", "params": {"a": 1, "b": 2}, "options": {"retryDelay": 10**9}},
    ],
)
def test_hostile_request_fields_are_invalid_params_not_crashes(
    shipped: Runner, request_: dict[str, Any]
) -> None:
    answer = shipped.handle(request_)
    assert answer["error"]["code"] == "INVALID_PARAMS", answer["error"]
    assert answer["metadata"]["attempts"] == 0


def _deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def test_deeply_nested_params_are_refused_and_still_audited(bench: ToolBench) -> None:
    bench.tool("ok", ECHO)
    answer = bench.runner().handle({"toolName": "ok", "params": {"deep": _deep(1500)}})
    assert answer["error"]["code"] == "INVALID_PARAMS"
    events = bench.audit_log.read_text().splitlines()
    assert [json.loads(line)["event"] for line in events] == ["policy.decision", "call.finished"]


def test_refused_requests_never_trip_the_breaker(bench: ToolBench) -> None:
    bench.tool("ok", ECHO)
    bench.policy["circuit_breaker"] = {"failure_threshold": 2, "reset_timeout_ms": 60000}
    runner = bench.runner()
    for _ in range(5):
        runner.handle({"toolName": "ok", "requestId": "a\u0000b"})
        runner.handle({"toolName": "ok", "params": {"deep": _deep(200)}})
    assert runner.handle({"toolName": "ok", "params": {"i": 1}})["result"] == {"i": 1}


def test_a_sensitive_value_never_appears_in_an_invalid_params_answer(bench: ToolBench) -> None:
    schema = {
        "type": "object",
        "properties": {"password": {"type": "string", "minLength": 20, "x-sensitive": True}},
    }
    bench.tool("login", ECHO, parameters=schema)
    answer = bench.runner().handle({"toolName": "login", "params": {"password": "hunter2"}})
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert "hunter2" not in json.dumps(answer)
