"""A null for an optional property the manifest does not let be null counts as left out:
what a strict export's model sends for a parameter it means to leave out."""

from __future__ import annotations

import json
from typing import Any

from conftest import ToolBench

from runner.schema.absent import without_absent_nulls
from runner.schema.compiled import build_validator

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "note": {"type": ["string", "null"]},
        "where": {"$ref": "#/$defs/place"},
        "stops": {"type": "array", "items": {"$ref": "#/$defs/place"}},
    },
    "required": ["city"],
    "additionalProperties": False,
    "$defs": {
        "place": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "label": {"type": "string"}},
            "required": ["lat"],
            "additionalProperties": False,
        }
    },
}


def _echo(bench: ToolBench, params: dict[str, Any]) -> dict[str, Any]:
    bench.tool("echo", ECHO, parameters=PARAMS)
    answer = bench.runner().handle({"toolName": "echo", "params": params})
    assert isinstance(answer, dict)
    return answer


def test_the_tool_never_sees_a_null_the_manifest_refuses_for_an_optional_property(bench: ToolBench) -> None:
    sent = {"city": "Oslo", "unit": None, "note": None, "where": {"lat": 1, "label": None},
            "stops": [{"lat": 2, "label": None}, {"lat": 3, "label": "x"}]}  # fmt: skip
    answer = _echo(bench, sent)
    assert answer["success"], answer
    # unit and the labels were left out; note takes null, so its null is a value.
    assert answer["result"] == {"city": "Oslo", "note": None, "where": {"lat": 1},
                                "stops": [{"lat": 2}, {"lat": 3, "label": "x"}]}  # fmt: skip
    decision = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    audited = next(event for event in decision if event["event"] == "policy.decision")
    assert "unit" not in audited["params"]  # the audit records what the tool got


def test_a_null_for_a_required_property_is_still_invalid(bench: ToolBench) -> None:
    answer = _echo(bench, {"city": None})
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert answer["error"]["details"]["field"] == "city"
    nested = _echo(bench, {"city": "Oslo", "where": {"lat": None}})
    assert nested["error"]["code"] == "INVALID_PARAMS"


def test_params_without_such_a_null_are_passed_on_as_the_very_same_object() -> None:
    validator = build_validator(PARAMS)
    params = {"city": "Oslo", "note": None, "stops": [{"lat": 1}]}
    assert without_absent_nulls(validator, params) is params


def test_an_unresolvable_ref_keeps_the_null_for_validation_to_judge() -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}
    assert without_absent_nulls(build_validator(schema), {"x": None}) == {"x": None}


def test_a_self_referencing_schema_and_deep_params_end_the_walk() -> None:
    schema = {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}}
    deep: dict[str, Any] = {"v": None}
    for _ in range(200):
        deep = {"next": deep}
    out = without_absent_nulls(build_validator(schema), {"v": None, "next": deep})
    assert "v" not in out  # walked at the top; the depth limit leaves the rest to validation
