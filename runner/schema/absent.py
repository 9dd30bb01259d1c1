"""A ``null`` for an optional property whose schema refuses ``null`` counts as left out.

OpenAI's strict mode has no optional properties: a strict export (``runner export
--strict``) makes each one required and nullable, and the model sends ``null`` for one it
means to leave out. The runner reads such a ``null`` as absent for every call, not only
for calls made from a strict export: it cannot tell which definitions a model was given
(MCP, the Python API and the command line all carry plain params), and such a ``null``
was invalid anyway, so no call that was valid before changes its meaning. A ``null`` the
property's schema accepts is passed on as it is.

The walk follows ``properties``, ``items`` and local ``$ref`` (as far as the strict
export makes properties nullable); it is bounded, and whatever it does not reach is left
to validation, which judges the params either way.
"""

from __future__ import annotations

from typing import Any

from jsonschema.protocols import Validator
from referencing.exceptions import Unresolvable

MAX_DEPTH = 32  # nesting levels of params walked; deeper ones are left to validation
MAX_REF_HOPS = 8  # a $ref to a $ref to ...


def without_absent_nulls(validator: Validator, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without the ``null`` of each optional property whose schema refuses
    ``null`` (``params`` itself when there is none)."""
    walk = _Walk(validator)
    out = walk.value(validator.schema, params, 0)
    return out if isinstance(out, dict) else params


class _Walk:
    def __init__(self, validator: Validator) -> None:
        self._validator = validator
        self._root = validator.schema

    def value(self, schema: Any, value: Any, depth: int) -> Any:
        schema = self._resolved(schema)
        if depth > MAX_DEPTH or not isinstance(schema, dict):
            return value
        if isinstance(value, dict):
            return self._object(schema, value, depth)
        items = self._resolved(schema.get("items"))
        nests = isinstance(items, dict) and ("properties" in items or "items" in items)
        if isinstance(value, list) and nests:
            # Only items that may hold objects are walked: a long list of scalars costs nothing.
            walked = [self.value(items, item, depth + 1) for item in value]
            return walked if any(new is not old for new, old in zip(walked, value, strict=True)) else value
        return value

    def _object(self, schema: dict[str, Any], value: dict[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return value
        required = schema.get("required")
        required = required if isinstance(required, list) else []
        out: dict[str, Any] = {}
        changed = False
        for key, item in value.items():
            sub = properties.get(key)
            if sub is None:
                out[key] = item
            elif item is None and key not in required and not self._takes_null(sub):
                changed = True
            else:
                out[key] = self.value(sub, item, depth + 1)
                changed = changed or out[key] is not item
        return out if changed else value

    def _takes_null(self, schema: Any) -> bool:
        # The validator's own resolver: a $ref in the property's schema resolves as it does
        # in validation. A null is cheap to validate; a schema that cannot be walked keeps
        # the null, for validation to report.
        try:
            return bool(self._validator.evolve(schema=schema).is_valid(None))
        except (Unresolvable, RecursionError):
            return True

    def _resolved(self, schema: Any) -> Any:
        """``schema`` with local ``$ref``s (``#/...``) followed; anything else as it is."""
        for _ in range(MAX_REF_HOPS):
            ref = schema.get("$ref") if isinstance(schema, dict) else None
            if not isinstance(ref, str) or not ref.startswith("#"):
                return schema
            target: Any = self._root
            for part in ref[1:].split("/")[1:]:
                key = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or key not in target:
                    return schema
                target = target[key]
            schema = target
        return schema
