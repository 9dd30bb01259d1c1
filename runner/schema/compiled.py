"""JSON Schema handling: Draft 2020-12, compiled once, never fetching a remote ``$ref``.

Validation uses ``runner.schema.keywords.SafeValidator`` (RE2 patterns, stoppable, recording
``x-sensitive`` values); ``check_params`` is the one validation of a call's params.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.protocols import Validator
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable

from runner.schema.absent import without_absent_nulls
from runner.schema.keywords import FORMAT_CHECKER, SafeValidator, ValidationExpired, validation_run
from runner.schema.redaction import REDACTED, Scrubber, holds_marked, nodes_at, redact_nodes
from runner.schema.suggest import did_you_mean


def _refuse_retrieval(uri: str) -> Resource[Any]:
    # A manifest is untrusted: resolving ``$ref`` over the network would let it make the
    # host fetch arbitrary URLs (and would make validation depend on the network).
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]  # attrs field, unknown to the stubs


_OFFLINE = Registry(retrieve=_refuse_retrieval)  # type: ignore[call-arg]
MAX_PROBLEM = 200
MAX_ERRORS = 20  # failing fields listed in an INVALID_PARAMS answer; the rest are counted
# Keywords whose messages name properties but never quote the value they reject.
_QUOTE_FREE = frozenset(
    {"required", "additionalProperties", "unevaluatedProperties", "dependentRequired", "dependencies"}
)


class SchemaProblem(ValueError):
    """The schema itself is not a valid Draft 2020-12 schema."""


def check_schema(schema: dict[str, Any] | bool) -> None:
    """Check ``schema`` against the Draft 2020-12 metaschema (milliseconds per schema).

    Raises:
        SchemaProblem: the schema is invalid, or RE2 cannot compile one of its patterns.
    """
    try:
        # The metaschema asks ``format: regex`` of every pattern: FORMAT_CHECKER means RE2.
        Draft202012Validator.check_schema(schema, format_checker=FORMAT_CHECKER)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        if exc.validator == "format" and exc.validator_value == "regex":
            raise SchemaProblem(
                f"pattern {exc.instance!r} at {where} is not supported: patterns are matched by RE2,"
                f" which has no lookarounds or backreferences ({exc.cause})"
            ) from exc
        raise SchemaProblem(f"invalid JSON Schema at {where}: {exc.message}{_type_hint(exc)}") from exc


JSON_SCHEMA_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")


def _type_hint(exc: SchemaError) -> str:
    """For an unknown ``type``: the closest type and the list of them ("did you mean")."""
    path = list(exc.absolute_path)
    if "type" not in path[-2:]:
        return ""
    unknown = [t for t in _as_list(exc.instance) if isinstance(t, str) and t not in JSON_SCHEMA_TYPES]
    if not unknown:
        return ""
    return f"{did_you_mean(unknown[0], JSON_SCHEMA_TYPES)}; the types are {', '.join(JSON_SCHEMA_TYPES)}"


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else [value]


def build_validator(schema: dict[str, Any] | bool) -> Validator:
    """A reusable validator for a schema that ``check_schema`` accepted."""
    return SafeValidator(schema, registry=_OFFLINE, format_checker=FORMAT_CHECKER)


def _sorted_errors(validator: Validator, instance: Any) -> list[ValidationError]:
    return sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path])


def _cut(text: str) -> str:
    return text if len(text) <= MAX_PROBLEM else text[:MAX_PROBLEM] + "..."


def _field(error: ValidationError) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(root)"


def _unresolvable(exc: Unresolvable) -> dict[str, str]:
    return {
        "field": "(schema)",
        "problem": f"unresolvable $ref {exc}; remote refs are never fetched",
        "validator": "$ref",
    }


def first_error(validator: Validator, instance: Any) -> dict[str, str] | None:
    """The most relevant validation error as ``{"field", "problem", "validator"}``, or None."""
    try:
        errors = _sorted_errors(validator, instance)
    except Unresolvable as exc:
        return _unresolvable(exc)
    except RecursionError:
        return {"field": "(root)", "problem": "too deeply nested to validate", "validator": "(depth)"}
    if not errors:
        return None
    error = errors[0]
    return {"field": _field(error), "problem": _cut(error.message), "validator": str(error.validator)}


@dataclass(frozen=True)
class ParamsCheck:
    """What validating a call's params found.

    ``problem`` is the first error (no secret in it) as ``field``, ``problem`` and
    ``validator``, plus ``errors``: every failing field as ``{"path", "message"}`` (at most
    ``MAX_ERRORS``, with ``moreErrors`` counting the rest), ``expired`` says the validation ran
    out of time, ``scrubber`` holds the request's sensitive strings, ``params`` are the
    params as validated and as the tool gets them (``runner.schema.absent``: a null for an
    optional property counts as left out) and ``audit_params`` are those with every
    sensitive value as ``***``.
    """

    problem: dict[str, Any] | None
    expired: bool
    scrubber: Scrubber
    params: dict[str, Any]
    audit_params: Any


def _describe(
    error: ValidationError,
    sensitive: frozenset[SensitivePath],
    marked_ids: frozenset[int],
    scrubber: Scrubber,
) -> tuple[str, str, str]:
    """``(field, message, keyword)`` of one error, with no sensitive value in the message."""
    field = _field(error)
    keyword = str(error.validator)
    if is_sensitive(field, sensitive) or (
        keyword not in _QUOTE_FREE and holds_marked(error.instance, marked_ids)
    ):
        # jsonschema quotes the value it rejects, a parent object with its secrets too.
        return field, f"value rejected by '{keyword}'", keyword
    return field, _cut(scrubber.scrub_text(error.message)), keyword


def check_params(
    validator: Validator,
    params: dict[str, Any],
    sensitive: frozenset[SensitivePath],
    budget_s: float,
) -> ParamsCheck:
    """Validate ``params`` within ``budget_s`` seconds, finding their sensitive values; a
    null for an optional property whose schema refuses null is left out first.

    Sensitive values are those the schema marks ``x-sensitive`` where validation applied
    the mark, plus those at the statically found ``sensitive`` paths (which also cover an
    ``anyOf`` branch the validation did not need to try).
    """
    stop_at = time.monotonic() + budget_s
    marked: list[object] = []
    expired = False
    errors: list[ValidationError] = []
    problem: dict[str, Any] | None = None
    # The nulls' walk too: a null can take as long as any value (an anyOf of $refs).
    with validation_run(stop_at, None), contextlib.suppress(Unresolvable, RecursionError):
        try:
            params = without_absent_nulls(validator, params)
        except ValidationExpired:
            expired = True
    with validation_run(stop_at, marked):
        try:
            if not expired:
                errors = _sorted_errors(validator, params)
        except ValidationExpired:
            expired = True
        except Unresolvable as exc:
            problem = _unresolvable(exc)
        except RecursionError:
            problem = {"field": "(root)", "problem": "too deeply nested to validate", "validator": "(depth)"}
    nodes = [*marked, *nodes_at(params, sensitive)]
    marked_ids = frozenset(id(node) for node in nodes)
    scrubber = Scrubber.of(nodes)
    if errors:
        described = [_describe(error, sensitive, marked_ids, scrubber) for error in errors[:MAX_ERRORS]]
        field, text, keyword = described[0]
        problem = {
            "field": field,
            "problem": text,
            "validator": keyword,
            "errors": [{"path": path, "message": message} for path, message, _ in described],
        }
        if len(errors) > MAX_ERRORS:
            problem["moreErrors"] = len(errors) - MAX_ERRORS
    elif problem is not None:  # the schema or the params could not be walked at all
        problem["errors"] = [{"path": problem["field"], "message": problem["problem"]}]
    cut_short = expired or (problem is not None and not errors)
    return ParamsCheck(
        problem=scrubber.scrub(problem) if problem is not None else None,
        expired=expired,
        scrubber=scrubber,
        params=params,
        # Cut short (out of time, a $ref it could not follow, too deep), the validation may
        # not have reached every sensitive value.
        audit_params=REDACTED if cut_short else redact_nodes(params, marked_ids),
    )


SensitivePath = tuple[str, ...]  # object keys, "*" for every item of an array
MAX_SCHEMA_WALK = 32
# Local $refs can make a small schema describe exponentially many paths; the walk stops
# here (validation still finds every applied mark, see ``check_params``).
MAX_WALK_STEPS = 10_000


def sensitive_paths(schema: object) -> frozenset[SensitivePath]:
    """Where in the params the schema marks values ``"x-sensitive": true``.

    Follows ``properties``, ``items``, ``allOf``/``anyOf``/``oneOf`` and local ``$ref``s,
    for at most ``MAX_WALK_STEPS`` subschemas.
    """
    found: set[SensitivePath] = set()
    stack: list[tuple[object, SensitivePath, int]] = [(schema, (), 0)]
    steps = 0
    while stack and steps < MAX_WALK_STEPS:
        node, prefix, depth = stack.pop()
        steps += 1
        if depth > MAX_SCHEMA_WALK or not isinstance(node, dict):
            continue
        if node.get("x-sensitive") is True:
            found.add(prefix)
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            target: object = schema
            for part in ref[2:].split("/"):
                key = part.replace("~1", "/").replace("~0", "~")
                target = target.get(key) if isinstance(target, dict) else None
            stack.append((target, prefix, depth + 1))
        properties = node.get("properties")
        if isinstance(properties, dict):
            stack.extend((sub, (*prefix, name), depth + 1) for name, sub in properties.items())
        stack.append((node.get("items"), (*prefix, "*"), depth + 1))
        for key in ("allOf", "anyOf", "oneOf"):
            subs = node.get(key)
            if isinstance(subs, list):
                stack.extend((sub, prefix, depth + 1) for sub in subs)
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
