"""Tool definitions: each provider's documented shape, and what cannot be expressed."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import mcp_types
import pytest
from conftest import ToolBench

from runner.errors import CallError, ErrorCode
from runner.tools.definitions import definitions

# The shapes each provider documents for a tool definition (OpenAI Chat Completions
# `tools[]`, Anthropic Messages `tools[]`): names ^[a-zA-Z0-9_-]{1,64}$, a root object schema.
NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
ROOT_OBJECT = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"const": "object"}},
    "not": {"anyOf": [{"required": [key]} for key in ("allOf", "anyOf", "oneOf", "not", "enum")]},
}
OPENAI_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "additionalProperties": False,
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "parameters"],
            "additionalProperties": False,
            "properties": {
                "name": NAME,
                "description": {"type": "string", "maxLength": 1024},
                "parameters": ROOT_OBJECT,
            },
        },
    },
}
ANTHROPIC_TOOL = {
    "type": "object",
    "required": ["name", "input_schema"],
    "additionalProperties": False,
    "properties": {"name": NAME, "description": {"type": "string"}, "input_schema": ROOT_OBJECT},
}

UNION_PARAMS = {
    "type": "object",
    "properties": {"path": {"type": "string", "x-sensitive": True}, "x-mode": {"type": "string"}},
    "oneOf": [{"required": ["path"]}, {"required": ["x-mode"]}],
    "$schema": "https://json-schema.org/draft/2020-12/schema",
}


@pytest.fixture
def tools_bench(bench: ToolBench) -> ToolBench:
    bench.tool(
        "plain",
        "",
        annotations={"readOnly": True, "idempotent": True, "openWorld": False},
        output_schema={"type": "object", "properties": {"n": {"type": "integer"}}},
    )
    bench.tool("union", "", parameters=UNION_PARAMS, output_schema={"type": "number"})
    bench.tool("dotted.name", "", annotations={"destructive": True})
    bench.policy["roles"] = {
        "user": {"allow": ["plain", "union"]},
        "admin": {"inherits": ["user"], "allow": ["*"]},
    }
    return bench


def test_openai_definitions_have_the_documented_shape_and_valid_schemas(tools_bench: ToolBench) -> None:
    tools = tools_bench.runner().tool_definitions("openai", role="admin")
    assert [t["function"]["name"] for t in tools] == ["plain", "union"]
    for tool in tools:
        jsonschema.validate(tool, OPENAI_TOOL)
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])


def test_anthropic_definitions_have_the_documented_shape_and_valid_schemas(tools_bench: ToolBench) -> None:
    tools = tools_bench.runner().tool_definitions("anthropic", role="admin")
    assert [t["name"] for t in tools] == ["plain", "union"]
    for tool in tools:
        jsonschema.validate(tool, ANTHROPIC_TOOL)
        jsonschema.Draft202012Validator.check_schema(tool["input_schema"])


def test_mcp_definitions_are_mcp_tools_with_annotations_and_object_output_schemas_only(
    tools_bench: ToolBench,
) -> None:
    tools = {t["name"]: t for t in tools_bench.runner().tool_definitions("mcp", role="admin")}
    assert set(tools) == {"plain", "union", "dotted.name"}  # MCP names may hold dots
    for tool in tools.values():
        mcp_types.Tool.model_validate(tool)
    assert tools["plain"]["annotations"] == {
        "readOnlyHint": True,
        "idempotentHint": True,
        "openWorldHint": False,
    }
    assert tools["plain"]["outputSchema"]["type"] == "object"
    assert "outputSchema" not in tools["union"]  # a number: not expressible as outputSchema
    assert tools["dotted.name"]["annotations"] == {"destructiveHint": True}
    assert "oneOf" in tools["union"]["inputSchema"]  # MCP takes the whole schema
    # JSON Schema 2020-12 as written, its dialect included; the runner's own keyword goes.
    assert tools["union"]["inputSchema"]["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "x-sensitive" not in json.dumps(tools["union"]["inputSchema"])


def test_what_a_format_cannot_express_is_left_out_and_reported(tools_bench: ToolBench) -> None:
    runner = tools_bench.runner()
    exported = definitions(runner.callable_tools("admin"), "anthropic")
    problems = {(note.tool, note.problem.split(";")[0]) for note in exported.notes}
    assert ("dotted.name", "the name is not valid for anthropic") in problems
    assert ("union", "root keywords oneOf cannot be expressed") in problems
    union = next(t for t in exported.tools if t["name"] == "union")["input_schema"]
    # The runner's own keyword and $schema go; a property that happens to be named x-mode stays.
    assert union["properties"] == {"path": {"type": "string"}, "x-mode": {"type": "string"}}
    assert "$schema" not in union


def test_definitions_list_only_what_the_role_may_call(tools_bench: ToolBench) -> None:
    runner = tools_bench.runner()
    assert [t["name"] for t in runner.tool_definitions("mcp")] == ["plain", "union"]  # default_role user
    with pytest.raises(CallError) as refused:
        runner.tool_definitions("mcp", role="nobody")
    assert refused.value.code is ErrorCode.PERMISSION_DENIED
    with pytest.raises(ValueError, match="unknown format"):
        runner.tool_definitions("gemini")


def _export(bench: ToolBench, *args: str) -> subprocess.CompletedProcess[str]:
    bench.write_policy()
    command = [
        sys.executable,
        "-m",
        "runner",
        "--tools",
        str(bench.tools),
        "--policies",
        str(bench.root / "policies.yaml"),
        "export",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_runner_export_prints_json_and_reports_what_it_left_out_on_stderr(tools_bench: ToolBench) -> None:
    done = _export(tools_bench, "--format", "openai", "--role", "admin")
    assert done.returncode == 0, done.stderr
    tools: list[dict[str, Any]] = json.loads(done.stdout)
    for tool in tools:
        jsonschema.validate(tool, OPENAI_TOOL)
    assert "dotted.name: the name is not valid for openai" in done.stderr


def test_runner_export_with_an_unknown_role_is_a_one_line_usage_error(tools_bench: ToolBench) -> None:
    done = _export(tools_bench, "--format", "mcp", "--role", "nobody")
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
