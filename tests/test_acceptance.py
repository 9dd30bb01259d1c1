"""The ten acceptance cases of the tool-caller design (TC-01..TC-10), through real sandboxes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conftest import ToolBench

from runner import Runner

SHELL_KEYS = {"success", "result", "error", "metadata"}
META_KEYS = {"duration", "attempts", "toolName", "timestamp", "requestId", "traceId"}

SLEEP = """
import json, sys, time
request = json.load(sys.stdin)
time.sleep(request["params"].get("seconds", 60))
print("{}")
"""
FAIL = """
import sys
sys.stdin.read()
print("boom", file=sys.stderr)
sys.exit(3)
"""


def assert_shell(answer: dict[str, Any]) -> None:
    assert set(answer) == SHELL_KEYS
    assert set(answer["metadata"]) >= META_KEYS
    if answer["success"]:
        assert answer["error"] is None
    else:
        assert answer["result"] is None
        assert set(answer["error"]) == {"code", "message", "details", "retryable"}
        assert "\n" not in answer["error"]["message"]


def test_tc01_discovery_lists_every_tool_the_role_may_call(shipped: Runner) -> None:
    answer = shipped.handle({"action": "discover"})
    assert_shell(answer)
    names = {tool["name"] for tool in answer["result"]["tools"]}
    assert {"add_numbers", "echo", "get_weather", "search_docs", "read_file"} <= names
    assert "write_file" not in names  # role user may not write
    assert answer["metadata"]["total"] == len(names)
    tool = next(t for t in answer["result"]["tools"] if t["name"] == "add_numbers")
    assert tool["paramsSchema"]["required"] == ["a", "b"]
    assert tool["metadata"]["tags"] == ["math"]
    assert tool["metadata"]["sandbox"] == "subprocess"
    assert tool["metadata"]["limits"]["timeoutMs"] == 2000


def test_tc02_discovery_filter_matches_name_description_and_tags(shipped: Runner) -> None:
    by_tag = shipped.handle({"action": "discover", "options": {"filter": "math"}})
    assert [t["name"] for t in by_tag["result"]["tools"]] == ["add_numbers"]
    by_description = shipped.handle({"action": "discover", "options": {"filter": "WEATHER"}})
    assert [t["name"] for t in by_description["result"]["tools"]] == ["get_weather"]
    admin = shipped.handle({"action": "discover", "options": {"filter": "file"}, "role": "admin"})
    assert {t["name"] for t in admin["result"]["tools"]} == {"read_file", "write_file", "delete_file"}
    assert admin["metadata"]["total"] == 3


def test_tc03_a_successful_call_returns_the_parsed_result(shipped: Runner) -> None:
    answer = shipped.handle(
        {"toolName": "get_weather", "params": {"city": "London"}, "requestId": "req_tc03"}
    )
    assert_shell(answer)
    assert answer["success"] is True
    assert answer["result"] == {"city": "London", "temperature": 9, "unit": "celsius", "condition": "rain"}
    assert answer["metadata"]["attempts"] == 1
    assert answer["metadata"]["requestId"] == "req_tc03"
    assert answer["metadata"]["toolName"] == "get_weather"
    assert answer["metadata"]["timestamp"].endswith("Z")


def test_tc04_a_timeout_counts_every_attempt_and_kills_the_tool(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("sleepy", SLEEP)
    answer = bench.runner().handle(
        {
            "toolName": "sleepy",
            "params": {"seconds": 30},
            "options": {"timeout": 200, "retries": 3, "retryDelay": 10, "deadline": 10000},
            "requestId": "req_tc04",
        }
    )
    assert_shell(answer)
    assert answer["error"]["code"] == "TIMEOUT"
    assert answer["error"]["retryable"] is True
    assert answer["metadata"]["attempts"] == 4
    assert answer["metadata"]["duration"] < 5000
    no_survivors("req_tc04")


def test_tc05_retries_exhausted_reports_the_last_error(bench: ToolBench) -> None:
    bench.tool("failing", FAIL)
    answer = bench.runner().handle({"toolName": "failing", "options": {"retries": 2, "retryDelay": 10}})
    assert_shell(answer)
    assert answer["error"]["code"] == "RETRY_EXHAUSTED"
    assert answer["metadata"]["attempts"] == 3
    last = answer["error"]["details"]["lastError"]
    assert last["code"] == "EXECUTION_ERROR"
    assert last["details"]["exitCode"] == 3
    assert "boom" in last["details"]["stderr"]


def test_tc06_an_unknown_tool_is_not_found(shipped: Runner) -> None:
    answer = shipped.handle({"toolName": "no_such_tool"})
    assert_shell(answer)
    assert answer["error"]["code"] == "TOOL_NOT_FOUND"
    assert answer["error"]["retryable"] is False
    assert answer["metadata"]["attempts"] == 0


def test_tc07_invalid_params_name_the_field(shipped: Runner) -> None:
    wrong_type = shipped.handle({"toolName": "add_numbers", "params": {"a": "one", "b": 2}})
    assert wrong_type["error"]["code"] == "INVALID_PARAMS"
    assert wrong_type["error"]["details"]["field"] == "a"
    missing = shipped.handle({"toolName": "add_numbers", "params": {"a": 1}})
    assert missing["error"]["code"] == "INVALID_PARAMS"
    extra = shipped.handle({"toolName": "add_numbers", "params": {"a": 1, "b": 2, "c": 3}})
    assert extra["error"]["code"] == "INVALID_PARAMS"
    assert extra["metadata"]["attempts"] == 0
    assert_shell(extra)


def test_tc08_a_failing_tool_is_an_execution_error_with_its_message(shipped: Runner) -> None:
    answer = shipped.handle(
        {
            "toolName": "get_weather",
            "params": {"city": "Atlantis"},
            "options": {"retries": 3, "retryDelay": 0},
        }
    )
    assert_shell(answer)
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["exitCode"] == 1
    # Its error document makes it a tool_error: not retried, not retryable.
    assert answer["error"]["details"]["reason"] == "tool_error"
    assert answer["error"]["retryable"] is False
    assert answer["metadata"]["attempts"] == 1
    assert "Atlantis" in answer["error"]["message"]


def test_tc09_output_that_is_not_json_is_a_parse_error(bench: ToolBench) -> None:
    bench.tool("chatty", "import sys\nsys.stdin.read()\nprint('hello, not json')\n")
    bench.tool(
        "off_schema",
        "import sys\nsys.stdin.read()\nprint('\"a string\"')\n",
        output_schema={"type": "number"},
    )
    runner = bench.runner()
    answer = runner.handle({"toolName": "chatty", "options": {"retries": 3}})
    assert_shell(answer)
    assert answer["error"]["code"] == "PARSE_ERROR"
    assert answer["metadata"]["attempts"] == 1  # a parse error is not retried
    raw = runner.handle({"toolName": "chatty", "options": {"format": "raw"}})
    assert raw["success"] is True
    assert raw["result"] == "hello, not json\n"
    off = runner.handle({"toolName": "off_schema"})
    assert off["error"]["code"] == "PARSE_ERROR"


def test_tc10_a_call_with_one_retry_answers_within_five_seconds(bench: ToolBench) -> None:
    bench.tool(
        "second_time_lucky",
        """
        import json, sys
        request = json.load(sys.stdin)
        if request["context"]["attempt"] < 2:
            sys.exit(1)
        json.dump({"attempt": request["context"]["attempt"]}, sys.stdout)
        """,
    )
    bench.policy["defaults"] = {"timeout_ms": 5000, "retries": 3, "retry_delay_ms": 1000, "deadline_ms": 5000}
    started = time.monotonic()
    answer = bench.runner().handle({"toolName": "second_time_lucky"})
    elapsed = time.monotonic() - started
    assert answer["success"] is True
    assert answer["result"] == {"attempt": 2}
    assert answer["metadata"]["attempts"] == 2
    assert elapsed < 5.0
