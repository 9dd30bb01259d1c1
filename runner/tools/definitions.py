"""Tool definitions for agents: OpenAI functions (Chat Completions and Responses), Anthropic
tools, MCP tools.

A manifest's schemas are JSON Schema 2020-12; each provider accepts a part of it. What a
provider cannot take is left out of the definition and reported as an ``ExportNote``,
never silently: the definition is only the model's guide, the runner still checks every
call against the manifest's full schema, so a keyword left out loosens the hint, never the
check. A tool whose name a provider refuses is left out of that provider's definitions
(renaming it would have the model call a name the runner does not know). With ``strict``,
the OpenAI formats give schemas OpenAI's strict mode accepts (``runner.tools.strict``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from runner.tools.manifest import Tool

# MCP's annotation hints, by the manifest's names for them: what a definition exports, and
# what a hosted server's listing is read back from (runner.tools.hosted). No pydantic here:
# `runner --help` imports this module.
MCP_HINTS = {
    "read_only": "readOnlyHint",
    "destructive": "destructiveHint",
    "idempotent": "idempotentHint",
    "open_world": "openWorldHint",
}


Format = Literal["openai", "openai-responses", "anthropic", "mcp"]
FORMATS: tuple[str, ...] = get_args(Format)
STRICT_FORMATS = ("openai", "openai-responses")  # the formats that have a strict mode

# OpenAI: function names ^[a-zA-Z0-9_-]{1,64}$; Anthropic: the same pattern for tool names;
# MCP (2025-11-25 and later): letters, digits, _ - . up to 128.
_NAME_RULES: dict[str, re.Pattern[str]] = {
    "openai": re.compile(r"[a-zA-Z0-9_-]{1,64}"),
    "openai-responses": re.compile(r"[a-zA-Z0-9_-]{1,64}"),
    "anthropic": re.compile(r"[a-zA-Z0-9_-]{1,64}"),
    "mcp": re.compile(r"[a-zA-Z0-9_.-]{1,128}"),
}
# OpenAI and Anthropic want the parameters' root to be a plain object schema: these root
# keywords (a union or condition over the whole object) are refused or ignored there.
_ROOT_ONLY_OBJECT = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "enum", "const")
# Keywords whose value is a map of subschemas, a list of them, or one.
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SUBSCHEMA_ONE = frozenset(
    {
        "not",
        "additionalProperties",
        "items",
        "contains",
        "propertyNames",
        "if",
        "then",
        "else",
        "unevaluatedProperties",
        "unevaluatedItems",
        "additionalItems",
    }
)


@dataclass(frozen=True)
class ExportNote:
    """Something of ``tool`` that the format cannot express, and what the export did."""

    tool: str
    problem: str


@dataclass(frozen=True)
class Definitions:
    """The definitions of one format, and what was left out of them."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    notes: list[ExportNote] = field(default_factory=list)


def definitions(tools: Iterable[Tool], fmt: str, *, strict: bool = False) -> Definitions:
    """The definitions of ``tools`` in format ``fmt`` (one of ``FORMATS``); ``strict``
    (``openai`` and ``openai-responses`` only): schemas for OpenAI's strict mode.

    Raises:
        ValueError: ``fmt`` is not one of ``FORMATS``, or ``strict`` with a format that has
            no strict mode.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if strict and fmt not in STRICT_FORMATS:
        raise ValueError(f"strict is for the formats {' and '.join(STRICT_FORMATS)}, not {fmt}")
    out = Definitions()
    for tool in tools:
        if not _NAME_RULES[fmt].fullmatch(tool.name):
            out.notes.append(ExportNote(tool.name, f"the name is not valid for {fmt}; the tool is left out"))
            continue
        if fmt == "mcp":
            out.tools.append(mcp_definition(tool, out.notes))
            continue
        params = plain_object_schema(tool, out.notes)
        strict_params = _strict(tool.name, params, out.notes) if strict else params
        if strict_params is not None:
            out.tools.append(_definition(fmt, tool.name, tool.manifest.description, strict_params, strict))
    return out


def _definition(
    fmt: str, name: str, description: str, params: dict[str, Any], strict: bool
) -> dict[str, Any]:
    if fmt == "anthropic":
        return {"name": name, "description": description, "input_schema": params}
    if fmt == "openai-responses":
        # The Responses API's flat shape; strict is given either way (it defaults to true there).
        flat = {"type": "function", "name": name, "description": description, "parameters": params}
        return {**flat, "strict": strict}
    function: dict[str, Any] = {"name": name, "description": description, "parameters": params}
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def _strict(name: str, params: dict[str, Any], notes: list[ExportNote]) -> dict[str, Any] | None:
    """``params`` for strict mode, what changed in ``notes``; None (the tool left out) when
    strict mode cannot express them."""
    from runner.tools.strict import NotStrict, strict_parameters

    try:
        converted, report = strict_parameters(params)
    except NotStrict as exc:
        notes.append(ExportNote(name, f"strict mode cannot express it: {exc}; the tool is left out"))
        return None
    notes.extend(ExportNote(name, problem) for problem in report.problems())
    return converted


def mcp_definition(tool: Tool, notes: list[ExportNote] | None = None) -> dict[str, Any]:
    """The tool as MCP's ``tools/list`` gives it (camelCase keys)."""
    manifest = tool.manifest
    definition: dict[str, Any] = {
        "name": tool.name,
        "description": manifest.description,
        # JSON Schema 2020-12 as written: ``$schema``, ``$defs`` and ``$ref`` stay.
        "inputSchema": clean_schema(manifest.parameters, keep_dialect=True),
    }
    output = manifest.output_schema
    if isinstance(output, dict) and output.get("type") == "object":
        definition["outputSchema"] = clean_schema(output, keep_dialect=True)
    elif output is not None and notes is not None:
        # MCP's outputSchema (and structuredContent) must be an object; the result still
        # travels as JSON text.
        notes.append(ExportNote(tool.name, "output_schema is not an object schema; outputSchema left out"))
    hints = {
        MCP_HINTS[key]: value for key, value in manifest.annotations.model_dump().items() if value is not None
    }
    if hints:
        definition["annotations"] = hints
    return definition


def plain_object_schema(tool: Tool, notes: list[ExportNote]) -> dict[str, Any]:
    """The parameters schema with the root keywords OpenAI and Anthropic refuse left out."""
    schema: dict[str, Any] = clean_schema(tool.manifest.parameters)
    dropped = [key for key in _ROOT_ONLY_OBJECT if key in schema]
    for key in dropped:
        del schema[key]
    if dropped:
        notes.append(
            ExportNote(tool.name, f"root keywords {', '.join(dropped)} cannot be expressed; left out")
        )
    return schema


def clean_schema(schema: Any, *, keep_dialect: bool = False) -> Any:
    """A copy of ``schema`` without the runner's own ``x-`` keywords (``x-sensitive``) and,
    unless ``keep_dialect``, without ``$schema``, at every level; subschemas are walked by
    keyword, so a property that happens to be named ``x-foo`` stays."""
    if not isinstance(schema, dict):
        return copy.deepcopy(schema)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if (key == "$schema" and not keep_dialect) or key.startswith("x-"):
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: clean_schema(sub, keep_dialect=keep_dialect) for name, sub in value.items()}
        elif (key in _SUBSCHEMA_LISTS or key == "items") and isinstance(value, list):
            out[key] = [clean_schema(sub, keep_dialect=keep_dialect) for sub in value]
        elif key in _SUBSCHEMA_ONE:
            out[key] = clean_schema(value, keep_dialect=keep_dialect)
        else:
            out[key] = copy.deepcopy(value)
    return out
