"""Exports as each provider's own SDK types them, and OpenAI's strict mode tested as rules.

The SDK types are the providers' published request types (``openai`` and ``anthropic``
packages, test dependencies); the strict-mode rules are those of OpenAI's Structured
Outputs guide ("Supported schemas"), written out here apart from the exporter's own table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import mcp_types
import pytest
from anthropic.types import ToolParam
from conftest import ToolBench, starter_dir
from openai.types.chat import ChatCompletionToolParam
from openai.types.responses import FunctionToolParam
from openai.types.shared_params import FunctionDefinition
from pydantic import TypeAdapter

from runner.tools.definitions import definitions
from runner.tools.strict import NotStrict, nullable, strict_parameters

# OpenAI's guide: supported types and keywords; the formats strings may name.
RULE_KEYWORDS = {
    "type", "description", "title", "enum", "const", "properties", "required",
    "additionalProperties", "items", "anyOf", "$defs", "definitions", "$ref",
    "pattern", "format", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "minItems", "maxItems",
}  # fmt: skip
RULE_FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
RULE_TYPES = {"string", "number", "boolean", "integer", "object", "array", "null"}


def strict_mode_violations(parameters: dict[str, Any]) -> list[str]:
    """What in ``parameters`` breaks OpenAI's strict-mode rules (empty: none)."""
    found: list[str] = []
    if parameters.get("type") != "object" or "anyOf" in parameters:
        found.append("(root): must be an object, not anyOf")

    def walk(node: Any, where: str, depth: int) -> None:
        if not isinstance(node, dict):
            found.append(f"{where}: not a schema object")
            return
        if depth > 10:
            found.append(f"{where}: nested deeper than 10")
        found.extend(f"{where}: keyword {key}" for key in node if key not in RULE_KEYWORDS)
        if "format" in node and node["format"] not in RULE_FORMATS:
            found.append(f"{where}: format {node['format']}")
        kinds = node.get("type", [])
        kinds = [kinds] if isinstance(kinds, str) else kinds
        found.extend(f"{where}: type {kind}" for kind in kinds if kind not in RULE_TYPES)
        if not kinds and not {"anyOf", "$ref", "enum", "const"} & set(node):
            found.append(f"{where}: no type")
        if "object" in kinds:
            properties = node.get("properties")
            if not isinstance(properties, dict):
                found.append(f"{where}: an object without properties")
                properties = {}
            if node.get("additionalProperties") is not False:
                found.append(f"{where}: additionalProperties is not false")
            if sorted(node.get("required", [])) != sorted(properties):
                found.append(f"{where or '(root)'}: not every property is required")
            for name, sub in properties.items():
                walk(sub, f"{where}/{name}", depth + 1)
        elif "properties" in node or "required" in node:
            found.append(f"{where}: object keywords on a non-object")
        if "array" in kinds and not isinstance(node.get("items"), dict):
            found.append(f"{where}: an array without one items schema")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}/*", depth + 1)
        for sub in node.get("anyOf", []):
            walk(sub, where, depth)
        for name, sub in {**node.get("$defs", {}), **node.get("definitions", {})}.items():
            walk(sub, f"{where}/$defs/{name}", depth)

    walk(parameters, "", 1)
    return found


def typed_as(kind: Any, value: dict[str, Any], nested: dict[str, Any] | None = None) -> None:
    """``value`` is a ``kind`` (a TypedDict of a provider's SDK) and has no key ``kind`` lacks."""
    TypeAdapter(kind).validate_python(value)
    assert set(value) <= set(kind.__annotations__), set(value) - set(kind.__annotations__)
    for key, inner in (nested or {}).items():
        typed_as(inner, value[key])


def _export(*args: str) -> tuple[list[dict[str, Any]], str]:
    root = starter_dir()
    command = [sys.executable, "-m", "runner", "--tools", str(root / "tools"), "--policies",
               str(root / "policies.yaml"), "export", "--role", "admin", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def _starter_tool_names() -> set[str]:
    return {folder.name for folder in (starter_dir() / "tools").iterdir() if (folder / "tool.yaml").is_file()}


def test_every_starter_tool_is_a_chat_completions_tool_param_with_and_without_strict() -> None:
    for args in ((), ("--strict",)):
        tools, _ = _export("--format", "openai", *args)
        assert {tool["function"]["name"] for tool in tools} == _starter_tool_names()
        for tool in tools:
            typed_as(ChatCompletionToolParam, tool, {"function": FunctionDefinition})
            assert tool["function"].get("strict", False) is bool(args)


def test_every_starter_tool_is_a_responses_function_tool_param_with_and_without_strict() -> None:
    for args in ((), ("--strict",)):
        tools, _ = _export("--format", "openai-responses", *args)
        assert {tool["name"] for tool in tools} == _starter_tool_names()
        for tool in tools:
            typed_as(FunctionToolParam, tool)
            # Given either way: the Responses API takes a missing strict as true.
            assert tool["strict"] is bool(args)


def test_every_starter_tool_is_an_anthropic_tool_param_and_an_mcp_tool() -> None:
    tools, _ = _export("--format", "anthropic")
    assert {tool["name"] for tool in tools} == _starter_tool_names()
    for tool in tools:
        typed_as(ToolParam, tool)
    for tool in _export("--format", "mcp")[0]:
        mcp_types.Tool.model_validate(tool)


@pytest.mark.parametrize("fmt", ["openai", "openai-responses"])
def test_strict_exports_of_the_starter_tools_pass_the_strict_mode_rules(fmt: str) -> None:
    tools, stderr = _export("--format", fmt, "--strict")
    for tool in tools:
        parameters = tool["function"]["parameters"] if fmt == "openai" else tool["parameters"]
        assert strict_mode_violations(parameters) == [], tool
        jsonschema.Draft202012Validator.check_schema(parameters)
    # What strict mode cannot take is said, per tool, on stderr.
    assert "get_weather: strict mode: default, maxLength, minLength left out" in stderr
    assert "get_weather: strict mode: optional unit made required and nullable" in stderr


def test_the_rules_checker_catches_each_kind_of_violation() -> None:
    """The checker above can fail: each rule on a schema that breaks only it."""
    assert strict_mode_violations({"type": "object", "properties": {}, "additionalProperties": False}) == []
    broken = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 1},
            "b": {"type": "object", "properties": {}, "required": []},
            "c": {"type": "string", "format": "uri"},
            "d": {"description": "no type"},
            "e": {"type": "array"},
        },
        "required": ["a", "b", "c", "d"],
        "additionalProperties": False,
    }
    found = "\n".join(strict_mode_violations(broken))
    for expected in ("/a: keyword minLength", "/b: additionalProperties", "(root): not every property",
                     "/c: format uri", "/d: no type", "/e: an array without"):  # fmt: skip
        assert expected in found


HARD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "pattern": "^[a-z]+$"},
        "when": {"type": "string", "format": "date-time"},
        "link": {"type": "string", "format": "uri"},
        "mode": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 5},
        "nested": {
            "type": "object",
            "properties": {"depth": {"type": "integer", "minimum": 0}, "label": {"type": "string"}},
            "required": ["depth"],
            "additionalProperties": {"type": "string"},
        },
        "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        "point": {"$ref": "#/$defs/point"},
        "fixed": {"const": "x"},
    },
    "required": ["name"],
    "$defs": {
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
    },
    "additionalProperties": False,
}


def test_a_schema_full_of_what_strict_mode_refuses_comes_out_passing_its_rules() -> None:
    converted, report = strict_parameters(HARD)
    assert strict_mode_violations(converted) == []
    jsonschema.Draft202012Validator.check_schema(converted)
    assert report.dropped == {"minLength", "format uri", "uniqueItems"}
    assert "strict mode: oneOf at /either given as anyOf" in report.other
    assert any("/nested takes only its listed properties" in text for text in report.other)
    # The optional ones take null now, and their own values still.
    validator = jsonschema.Draft202012Validator(converted)
    full = {"name": "ab", "when": None, "link": None, "mode": None, "tags": None, "nested": None,
            "either": None, "point": None, "fixed": None}  # fmt: skip
    assert validator.is_valid(full)
    nested = {"depth": 1, "label": None}
    point = {"x": 1, "y": None}
    assert validator.is_valid({**full, "mode": "a", "nested": nested, "point": point, "fixed": "x"})
    assert not validator.is_valid({**full, "mode": "c"})
    assert not validator.is_valid({**full, "nested": {"depth": None, "label": None}})  # was required


def test_nullable_keeps_a_schema_that_takes_null_and_adds_null_where_it_does_not() -> None:
    assert nullable({"type": ["string", "null"]}) == {"type": ["string", "null"]}
    assert nullable({"type": "integer", "enum": [1, 2]}) == {
        "type": ["integer", "null"],
        "enum": [1, 2, None],
    }
    assert nullable({"$ref": "#/$defs/x"}) == {"anyOf": [{"$ref": "#/$defs/x"}, {"type": "null"}]}


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "object", "properties": {"any": {}}}, "/any has no type"),
        ({"type": "object", "properties": {"list": {"type": "array"}}}, "/list is an array without items"),
        ({"type": "object", "properties": {"x": True}}, "/x: a schema of true or false"),
        ({"type": "object", "properties": {}, "required": ["ghost"]}, "requires ghost"),
    ],
)
def test_a_schema_strict_mode_cannot_express_leaves_the_tool_out_and_says_why(
    bench: ToolBench, schema: dict[str, Any], why: str
) -> None:
    bench.tool("odd", "", parameters=schema)
    bench.tool("fine", "", parameters={"type": "object", "properties": {"a": {"type": "string"}}})
    runner = bench.runner()
    exported = definitions(runner.callable_tools(None), "openai-responses", strict=True)
    assert [tool["name"] for tool in exported.tools] == ["fine"]
    notes = [note.problem for note in exported.notes if note.tool == "odd"]
    assert len(notes) == 1 and why in notes[0] and notes[0].endswith("the tool is left out")


def test_a_schema_nested_past_strict_modes_limit_leaves_the_tool_out() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(11):
        schema = {"type": "object", "properties": {"in": schema}, "required": ["in"]}
    with pytest.raises(NotStrict, match="nested 11 deep"):
        strict_parameters(schema)


def test_strict_with_anthropic_or_mcp_is_a_one_line_usage_error() -> None:
    root = starter_dir()
    for fmt in ("anthropic", "mcp"):
        done = subprocess.run(
            [sys.executable, "-m", "runner", "--tools", str(root / "tools"), "--policies",
             str(root / "policies.yaml"), "export", "--format", fmt, "--strict"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2 and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    with pytest.raises(ValueError, match="strict is for"):
        definitions([], "anthropic", strict=True)
