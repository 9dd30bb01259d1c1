"""OpenAI's strict mode for exported parameters schemas.

Strict mode (Structured Outputs for function calls) takes a part of JSON Schema: every
object lists all its properties as required and allows no others, and only some keywords
are accepted. ``strict_parameters`` turns a tool's plain object schema into one strict
mode accepts:

- an optional property becomes required and nullable; the runner reads a ``null`` there
  as the property left out (``runner.schema.absent``), so the model keeps its choice;
- every object gets ``additionalProperties: false`` and all its properties in ``required``;
- ``oneOf`` becomes ``anyOf`` (the hint loosens; the check does not);
- any other keyword strict mode refuses is left out, and reported.

What cannot be made strict at all (a subschema with no type, an array without ``items``, a
schema past strict mode's size limits) leaves the tool out of the strict export, reported:
a schema OpenAI would refuse would fail the whole request, not just that tool.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# What OpenAI's Structured Outputs guide lists as supported ("Supported schemas"): the
# types, anyOf, definitions and $ref, and these constraints; title and description are
# annotations it keeps.
STRICT_KEYWORDS = frozenset(
    {
        "type",
        "title",
        "description",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "anyOf",
        "$defs",
        "definitions",
        "$ref",
        "pattern",
        "format",
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "minItems",
        "maxItems",
    }
)
STRICT_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)
# The guide's limits: nesting levels, object properties in all, enum values in all.
MAX_DEPTH = 10
MAX_PROPERTIES = 5000
MAX_ENUM_VALUES = 1000
_TYPED_BY = ("type", "anyOf", "$ref", "enum", "const")


class NotStrict(Exception):
    """The schema cannot be given in strict mode; the message says where and why."""


@dataclass
class StrictReport:
    """What the conversion changed in one tool's schema, for the export's notes."""

    dropped: set[str] = field(default_factory=set)
    nullable: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)

    def problems(self) -> Iterable[str]:
        if self.dropped:
            yield f"strict mode: {', '.join(sorted(self.dropped))} left out"
        if self.nullable:
            yield (
                f"strict mode: optional {', '.join(self.nullable)} made required and nullable"
                " (null counts as left out)"
            )
        yield from self.other


def strict_parameters(schema: dict[str, Any]) -> tuple[dict[str, Any], StrictReport]:
    """``schema`` (a plain object schema, already cleaned) as strict mode takes it.

    Raises:
        NotStrict: a part of the schema cannot be expressed in strict mode.
    """
    walk = _Walk()
    out = walk.node(schema, "", depth=1)
    if walk.properties > MAX_PROPERTIES:
        raise NotStrict(f"{walk.properties} object properties; strict mode takes at most {MAX_PROPERTIES}")
    if walk.enum_values > MAX_ENUM_VALUES:
        raise NotStrict(f"{walk.enum_values} enum values; strict mode takes at most {MAX_ENUM_VALUES}")
    return out, walk.report


def _types(schema: dict[str, Any]) -> list[Any]:
    kind = schema.get("type")
    return list(kind) if isinstance(kind, list) else [kind] if kind is not None else []


def _is_object(schema: dict[str, Any]) -> bool:
    return "object" in _types(schema) or "properties" in schema


def _where(path: str) -> str:
    return path or "the parameters"


class _Walk:
    def __init__(self) -> None:
        self.report = StrictReport()
        self.properties = 0
        self.enum_values = 0

    def node(self, schema: Any, path: str, depth: int) -> dict[str, Any]:
        if not isinstance(schema, dict):
            raise NotStrict(f"{_where(path)}: a schema of true or false cannot be expressed")
        if depth > MAX_DEPTH:
            raise NotStrict(f"{_where(path)} is nested {depth} deep; strict mode takes {MAX_DEPTH}")
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "oneOf" and isinstance(value, list):
                self.report.other.append(f"strict mode: oneOf at {_where(path)} given as anyOf")
                self._keyword(out, "anyOf", value, path, depth)  # the same subschemas, any of them
            elif key not in STRICT_KEYWORDS or (key == "format" and value not in STRICT_FORMATS):
                self.report.dropped.add(f"format {value}" if key == "format" else key)
            elif key not in ("required", "additionalProperties"):  # both: set for objects below
                self._keyword(out, key, value, path, depth)
        if isinstance(out.get("enum"), list):
            self.enum_values += len(out["enum"])
        if _is_object(schema):
            self._object(schema, out, path)
        elif "required" in schema or "additionalProperties" in schema:
            self.report.dropped.update(key for key in ("required", "additionalProperties") if key in schema)
        if not any(key in out for key in _TYPED_BY):
            raise NotStrict(f"{_where(path)} has no type")
        if "array" in _types(out) and "items" not in out:
            raise NotStrict(f"{_where(path)} is an array without items")
        return out

    def _keyword(self, out: dict[str, Any], key: str, value: Any, path: str, depth: int) -> None:
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            inner = depth + 1 if key == "properties" else depth
            out[key] = {name: self.node(sub, f"{path}/{name}", inner) for name, sub in value.items()}
        elif key == "anyOf" and isinstance(value, list):
            out[key] = [self.node(sub, path, depth) for sub in value]
        elif key == "items" and isinstance(value, dict):
            out[key] = self.node(value, f"{path}/*", depth + 1)
        elif key == "items":
            self.report.dropped.add("items as a list")
        else:
            out[key] = copy.deepcopy(value)

    def _object(self, schema: dict[str, Any], out: dict[str, Any], path: str) -> None:
        properties: dict[str, Any] = out.setdefault("properties", {})
        self.properties += len(properties)
        out.setdefault("type", "object")
        extra = schema.get("additionalProperties", False)
        if extra is not False:
            self.report.other.append(
                f"strict mode: {_where(path)} takes only its listed properties (additionalProperties: false)"
            )
        out["additionalProperties"] = False
        required = schema.get("required", [])
        unlisted = [name for name in required if name not in properties]
        if unlisted:
            raise NotStrict(f"{_where(path)} requires {', '.join(unlisted)}, which it does not list")
        for name, sub in properties.items():
            if name not in required:
                properties[name] = nullable(sub)
                self.report.nullable.append(f"{path}/{name}".lstrip("/"))
        out["required"] = list(properties)


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` that also takes ``null`` (unchanged when it already does, as far as its
    type, enum or anyOf say)."""
    if "$ref" in schema or "const" in schema:
        return {"anyOf": [schema, {"type": "null"}]}
    out = dict(schema)
    if "type" in out and "null" not in _types(out):
        out["type"] = [*_types(out), "null"]
    if isinstance(out.get("enum"), list) and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    if isinstance(out.get("anyOf"), list) and {"type": "null"} not in out["anyOf"]:
        out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    return out
