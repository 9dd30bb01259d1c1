"""JSON Schema handling: Draft 2020-12, compiled once, never fetching a remote ``$ref``."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable


def _refuse_retrieval(uri: str) -> Resource[Any]:
    # A manifest is untrusted: resolving ``$ref`` over the network would let it make the
    # host fetch arbitrary URLs (and would make validation depend on the network).
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]  # attrs field, unknown to the stubs


_OFFLINE = Registry(retrieve=_refuse_retrieval)  # type: ignore[call-arg]


class SchemaProblem(ValueError):
    """The schema itself is not a valid Draft 2020-12 schema."""


def compile_schema(schema: dict[str, Any] | bool) -> Draft202012Validator:
    """A reusable validator for ``schema``.

    Raises:
        SchemaProblem: the schema is invalid.
    """
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise SchemaProblem(f"invalid JSON Schema at {where}: {exc.message}") from exc
    return Draft202012Validator(schema, registry=_OFFLINE, format_checker=Draft202012Validator.FORMAT_CHECKER)


def first_error(validator: Draft202012Validator, instance: Any) -> dict[str, str] | None:
    """The most relevant validation error as ``{"field", "problem"}``, or None when valid."""
    try:
        errors = sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path])
    except Unresolvable as exc:
        return {
            "field": "(schema)",
            "problem": f"unresolvable $ref {exc}; remote refs are never fetched",
            "validator": "$ref",
        }
    if not errors:
        return None
    error = errors[0]
    field = "/".join(str(p) for p in error.absolute_path) or "(root)"
    message = error.message
    if len(message) > 200:
        message = message[:200] + "..."
    return {"field": field, "problem": message, "validator": str(error.validator)}


SensitivePath = tuple[str, ...]  # object keys, "*" for every item of an array
MAX_SCHEMA_WALK = 32


def sensitive_paths(
    schema: object, root: object = None, prefix: SensitivePath = (), depth: int = 0
) -> frozenset[SensitivePath]:
    """Where in the params the schema marks values ``"x-sensitive": true``.

    Follows ``properties``, ``items``, ``allOf``/``anyOf``/``oneOf`` and local ``$ref``s.
    """
    root = schema if root is None else root
    if depth > MAX_SCHEMA_WALK or not isinstance(schema, dict):
        return frozenset()
    if schema.get("x-sensitive") is True:
        return frozenset({prefix})
    found: set[SensitivePath] = set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: object = root
        for part in ref[2:].split("/"):
            target = (
                target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            )
        found |= sensitive_paths(target, root, prefix, depth + 1)
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for name, sub in properties.items():
            found |= sensitive_paths(sub, root, (*prefix, name), depth + 1)
    found |= sensitive_paths(schema.get("items"), root, (*prefix, "*"), depth + 1)
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found |= sensitive_paths(sub, root, prefix, depth + 1)
    return frozenset(found)


def is_sensitive(field: str, paths: frozenset[SensitivePath]) -> bool:
    """Does an error's field (``a/b/0``) lie at or under a sensitive path?"""
    parts = [] if field in ("(root)", "") else field.split("/")
    for path in paths:
        if len(parts) >= len(path) and all(
            step in ("*", part) for step, part in zip(path, parts, strict=False)
        ):
            return True
    return False
