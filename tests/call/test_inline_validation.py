"""Light params of a linear schema (and a short result against a linear output schema)
are validated on the event loop: the same validation, the same verdicts, no thread hop;
anything else still goes to a worker thread."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from conftest import ToolBench

from runner.call import guard
from runner.schema.inline import INLINE_WEIGHT, is_light, is_linear

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
LINEAR = {
    "type": "object",
    "title": "args",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 40},
        "token": {"type": "string", "x-sensitive": True, "minLength": 8},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 7},
    },
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "schema",
    [
        {"anyOf": [{"type": "string"}, {"type": "null"}]},
        {"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}},
        {"type": "array", "items": {"not": {"type": "string"}}},
        {"type": "array", "uniqueItems": True},
        {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}},
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        {"type": "array", "contains": {"type": "string"}},
        {"type": "object", "unevaluatedProperties": False},
        {"type": "object", "x-unknown": {"anyOf": []}},  # an unknown keyword: not trusted
        {"type": "object", "properties": ["not", "a", "map"]},
        # constant per node, but not in time: an RE2 search grows with the text, and
        # ``format: regex`` compiles every string it meets
        {"type": "string", "pattern": "^[A-Z]"},
        {"type": "object", "patternProperties": {"^a": {"type": "string"}}},
        {"type": "array", "items": {"type": "string", "format": "regex"}},
    ],
)
def test_a_schema_that_can_visit_a_node_more_than_once_is_not_linear(schema: dict[str, Any]) -> None:
    assert is_linear(schema) is False


def test_a_schema_of_one_pass_keywords_is_linear() -> None:
    assert is_linear(LINEAR)
    assert is_linear(True)
    assert is_linear({"type": "array", "prefixItems": [{"type": "string"}], "items": False})


def test_weight_counts_nodes_and_characters_and_stops_at_once_past_the_bound() -> None:
    assert is_light({"city": "Oslo", "days": [1, 2]})
    assert not is_light({"text": "x" * INLINE_WEIGHT})
    assert not is_light({"k" * INLINE_WEIGHT: 1})
    assert not is_light([[[0] * 100] * 100])
    wide = list(range(5_000_000))
    started = time.monotonic()
    assert not is_light({"xs": wide})
    assert time.monotonic() - started < 0.05  # refused by its length, not walked


def _submits(bench: ToolBench, tool: str, params: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The answer of a denied call of ``tool`` (validated, never run) and how many jobs
    went to the runner's validation threads meanwhile."""
    runner = bench.runner()
    threads = runner._threads  # the pool validation hops to
    submitted = 0
    submit = threads.submit

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal submitted
        submitted += 1
        return submit(*args, **kwargs)

    threads.submit = counting  # type: ignore[method-assign]
    try:
        answer = runner.handle({"toolName": tool, "params": params})
    finally:
        runner.close()
    assert isinstance(answer, dict)
    return answer, submitted


def test_light_params_of_a_linear_schema_are_validated_without_a_thread_heavy_ones_with(
    bench: ToolBench,
) -> None:
    bench.tool("linear", ECHO, parameters=LINEAR)
    bench.tool("branchy", ECHO, parameters={"type": "object", "anyOf": [{"required": ["city"]}]})
    bench.policy["roles"] = {"user": {"allow": []}}  # denied after validation: nothing runs
    answer, submitted = _submits(bench, "linear", {"city": "Oslo"})
    assert (answer["error"]["code"], submitted) == ("PERMISSION_DENIED", 0)
    assert _submits(bench, "linear", {"city": "O" * 5000})[1] == 1
    assert _submits(bench, "branchy", {"city": "Oslo"})[1] == 1


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "threaded"])
def test_inline_validation_gives_the_same_verdicts_and_keeps_a_sensitive_value_out(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    if not inline:  # the same requests down the thread's path: the same answers
        monkeypatch.setattr(guard, "is_light", lambda value: False)
    bench.tool("linear", ECHO, parameters=LINEAR)
    runner = bench.runner()
    secret = "hunter2"  # too short for minLength: rejected, and never quoted
    answer = runner.handle({"toolName": "linear", "params": {"city": "Oslo", "token": secret}})
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert answer["error"]["details"]["field"] == "token"
    answer = runner.handle({"toolName": "linear", "params": {"city": "o", "days": [0], "x": 1}})
    fields = sorted(error["path"] for error in answer["error"]["details"]["errors"])
    assert fields == ["(root)", "city", "days/0"]
    answer = runner.handle({"toolName": "linear", "params": {"city": "Oslo", "token": "a-long-token"}})
    assert answer["success"], answer
    runner.close()
    text = bench.audit_log.read_text()
    assert secret not in text and "a-long-token" not in text
    decisions = [json.loads(line) for line in text.splitlines() if '"policy.decision"' in line]
    assert decisions[-1]["params"]["token"] == "***"


def test_a_short_result_is_still_checked_against_a_linear_output_schema(bench: ToolBench) -> None:
    output = {"type": "object", "properties": {"city": {"type": "integer"}}, "required": ["city"]}
    bench.tool("linear", ECHO, parameters=LINEAR, output_schema=output)
    answer = bench.runner().handle({"toolName": "linear", "params": {"city": "Oslo"}})
    assert answer["error"]["code"] == "PARSE_ERROR"
    assert answer["error"]["details"]["field"] == "city"
