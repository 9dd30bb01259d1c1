"""The JSON Schema validator class of the runner: Draft 2020-12 made safe for hostile input.

jsonschema's own keywords are kept, with these changes:

- ``pattern``, ``patternProperties``, and the ``additionalProperties`` and
  ``unevaluatedProperties`` that look at patternProperties match with RE2
  (``runner.schema.patterns``): linear time, never a stall. ``format: regex`` means an RE2 regex.
- ``uniqueItems`` runs in linear time (jsonschema falls back to comparing every pair).
- ``multipleOf`` takes an integer too large for a float (jsonschema's divides it as one).
- Every keyword first checks the validation's stop time (``validation_run``), so a
  validation running past the call's deadline ends at the next keyword with
  ``ValidationExpired`` instead of running on in its thread.
- ``x-sensitive: true`` records the value it applies to, wherever the schema applies it
  (properties, additionalProperties, patternProperties, prefixItems, if/then, $ref ...).

The keyword functions follow jsonschema's ``_keywords.py`` (MIT licence).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from fractions import Fraction
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker
from jsonschema import _utils as jsonschema_utils
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator
from jsonschema.validators import extend

from runner.schema.patterns import PatternError, compile_pattern, search

Keyword = Callable[[Any, Any, Any, Any], Iterable[ValidationError] | None]


class ValidationExpired(Exception):  # a signal, not an error of the input
    """The validation ran past its stop time."""


_STOP_AT: ContextVar[float | None] = ContextVar("runner_validation_stop_at", default=None)
_MARKED: ContextVar[list[object] | None] = ContextVar("runner_validation_marked", default=None)


@contextlib.contextmanager
def validation_run(stop_at: float | None, marked: list[object] | None) -> Iterator[None]:
    """Within this block (in this thread), validations stop at ``stop_at`` (time.monotonic)
    and append the values marked ``x-sensitive`` to ``marked``."""
    stop_token = _STOP_AT.set(stop_at)
    marked_token = _MARKED.set(marked)
    try:
        yield
    finally:
        _STOP_AT.reset(stop_token)
        _MARKED.reset(marked_token)


def _match(pattern: str, text: str) -> bool:
    try:
        return search(pattern, text)
    except PatternError as exc:
        # Refused when the manifest was loaded; reaching here means a schema that was not.
        raise ValidationError(f"pattern {pattern!r} cannot be used: {exc}") from exc


def pattern(validator: Any, patrn: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _match(patrn, instance):
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


def pattern_properties(
    validator: Any, pattern_props: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in pattern_props.items():
        for key, value in instance.items():
            if _match(patrn, key):
                yield from validator.descend(value, subschema, path=key, schema_path=patrn)


def _additional(instance: Any, schema: Any) -> Iterator[str]:
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    for key in instance:
        if key not in properties and not any(_match(patrn, key) for patrn in patterns):
            yield key


def additional_properties(
    validator: Any, extra: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    extras = set(_additional(instance, schema))
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            patterns = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {patterns}")
        else:
            listed, verb = jsonschema_utils.extras_msg(sorted(extras, key=str))
            yield ValidationError(f"Additional properties are not allowed ({listed} {verb} unexpected)")


def _is_valid(errors: Iterable[ValidationError]) -> bool:
    return next(iter(errors), None) is None


def _evaluated_keys(validator: Any, instance: Any, schema: Any) -> list[str]:
    """jsonschema's ``find_evaluated_property_keys_by_schema``, matching patterns with RE2."""
    if validator.is_type(schema, "boolean"):
        return []
    keys = _keys_through_refs(validator, instance, schema)
    properties = schema.get("properties")
    if validator.is_type(properties, "object"):
        keys += properties.keys() & instance.keys()
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        subschema = schema.get(keyword)
        if subschema is not None:
            keys += (key for key, value in instance.items() if _is_valid(validator.descend(value, subschema)))
    if "patternProperties" in schema:
        keys += (key for key in instance if any(_match(p, key) for p in schema["patternProperties"]))
    for key, subschema in schema.get("dependentSchemas", {}).items():
        if key in instance:
            keys += _evaluated_keys(validator, instance, subschema)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, []):
            if _is_valid(validator.descend(instance, subschema)):
                keys += _evaluated_keys(validator, instance, subschema)
    return keys + _keys_through_conditionals(validator, instance, schema)


def _keys_through_refs(validator: Any, instance: Any, schema: Any) -> list[str]:
    keys: list[str] = []
    for ref_keyword in ("$ref", "$dynamicRef"):
        ref = schema.get(ref_keyword)
        if ref is not None:
            resolved = validator._resolver.lookup(ref)
            keys += _evaluated_keys(
                validator.evolve(schema=resolved.contents, _resolver=resolved.resolver),
                instance,
                resolved.contents,
            )
    return keys


def _keys_through_conditionals(validator: Any, instance: Any, schema: Any) -> list[str]:
    if "if" not in schema:
        return []
    if validator.evolve(schema=schema["if"]).is_valid(instance):
        keys = _evaluated_keys(validator, instance, schema["if"])
        if "then" in schema:
            keys += _evaluated_keys(validator, instance, schema["then"])
        return keys
    if "else" in schema:
        return _evaluated_keys(validator, instance, schema["else"])
    return []


def unevaluated_properties(
    validator: Any, unevaluated: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    evaluated = set(_evaluated_keys(validator, instance, schema))
    failing = [
        key
        for key in instance
        if key not in evaluated
        and not _is_valid(validator.descend(instance[key], unevaluated, path=key, schema_path=key))
    ]
    if failing:
        if unevaluated is False:
            listed, verb = jsonschema_utils.extras_msg(sorted(failing, key=str))
            yield ValidationError(f"Unevaluated properties are not allowed ({listed} {verb} unexpected)")
        else:
            listed, verb = jsonschema_utils.extras_msg(failing)
            yield ValidationError(
                "Unevaluated properties are not valid under the given schema "
                f"({listed} {verb} unevaluated and invalid)"
            )


class _Unhashable(Exception):
    pass


def _canonical(value: Any) -> object:
    """A hashable key equal for exactly the values jsonschema calls equal (1 == 1.0, True != 1)."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", value)
    if isinstance(value, str):
        return ("string", value)
    if value is None:
        return ("null",)
    if isinstance(value, list):
        return ("array", tuple(_canonical(item) for item in value))
    if isinstance(value, dict):
        return ("object", frozenset((key, _canonical(item)) for key, item in value.items()))
    raise _Unhashable


def unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not unique or not validator.is_type(instance, "array"):
        return
    try:
        distinct = len({_canonical(item) for item in instance}) == len(instance)
    except _Unhashable:
        distinct = jsonschema_utils.uniq(instance)
    if not distinct:
        yield ValidationError(f"{instance!r} has non-unique elements")


def x_sensitive(validator: Any, marked: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    collected = _MARKED.get()
    if marked is True and collected is not None:
        collected.append(instance)
    return iter(())


def multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    try:
        yield from list(Draft202012Validator.VALIDATORS["multipleOf"](validator, divisor, instance, schema))
    except OverflowError:  # exact, as jsonschema's own fallback is once the quotient overflows
        if (Fraction(instance) / Fraction(divisor)).denominator != 1:
            yield ValidationError(f"{instance!r} is not a multiple of {divisor}")


def _interruptible(keyword: Keyword) -> Keyword:
    def checked(validator: Any, value: Any, instance: Any, schema: Any) -> Iterable[ValidationError] | None:
        stop_at = _STOP_AT.get()
        if stop_at is not None and time.monotonic() > stop_at:
            raise ValidationExpired
        return keyword(validator, value, instance, schema)

    return checked


def _is_re2(instance: object) -> bool:
    if isinstance(instance, str):
        compile_pattern(instance)
    return True


# ``format: regex`` (in schemas, where the metaschema asks it of every pattern, and in
# params) means: RE2 can compile it. Python's ``re.compile`` can also raise RecursionError.
FORMAT_CHECKER = FormatChecker(formats=())
FORMAT_CHECKER.checkers = dict(Draft202012Validator.FORMAT_CHECKER.checkers)
FORMAT_CHECKER.checks("regex", raises=PatternError)(_is_re2)

_OVERRIDES: dict[str, Keyword] = {
    "pattern": pattern,
    "patternProperties": pattern_properties,
    "additionalProperties": additional_properties,
    "unevaluatedProperties": unevaluated_properties,
    "uniqueItems": unique_items,
    "multipleOf": multiple_of,
    "x-sensitive": x_sensitive,
}

SafeValidator: type[Validator] = extend(  # type: ignore[no-untyped-call]
    Draft202012Validator,
    validators={
        name: _interruptible(keyword)
        for name, keyword in {**Draft202012Validator.VALIDATORS, **_OVERRIDES}.items()
    },
    format_checker=FORMAT_CHECKER,
)
