"""Which validations are cheap enough for the event loop.

A call's params (and a result against an ``output_schema``) are validated in a worker
thread under the call's deadline, because a schema and an instance together can make
validation slow: combinators try every branch at every level, ``uniqueItems`` compares
pairs, ``$ref`` can loop. A *linear* schema uses only keywords that look at each node of
the instance once, each in constant time: no ``pattern`` (an RE2 search grows with the
text times the pattern's program) and no ``format`` (``regex`` compiles each string, and a
failed compile is never cached). With a *light* instance (few nodes, short strings) its
validation is microseconds, less than the two thread hops around it, so it runs inline.
Either way it is the same validation, with the same verdict.
"""

from __future__ import annotations

from typing import Any

# Most nodes plus characters of strings and keys an instance validated inline may have.
INLINE_WEIGHT = 4096

# Keywords that check the instance node they sit at once, or only annotate it.
_ASSERTIONS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "maxItems", "minItems",
        "maxProperties", "minProperties", "required", "dependentRequired", "x-sensitive",
        "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
        "$comment", "$schema", "contentEncoding", "contentMediaType",
    }
)  # fmt: skip
# Keywords whose subschema applies to each child node at most once.
_ONE_SUBSCHEMA = frozenset({"items", "additionalProperties", "propertyNames"})
_SUBSCHEMA_MAPS = frozenset({"properties"})
_SUBSCHEMA_LISTS = frozenset({"prefixItems"})


def is_linear(schema: Any) -> bool:
    """Whether ``schema`` validates an instance in one pass over its nodes."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return False
        for keyword, value in node.items():
            if keyword in _ASSERTIONS:
                continue
            if keyword in _ONE_SUBSCHEMA:
                stack.append(value)
            elif keyword in _SUBSCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif keyword in _SUBSCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            else:
                return False
    return True


def is_light(value: Any, limit: int = INLINE_WEIGHT) -> bool:
    """Whether ``value`` (a JSON value) has at most ``limit`` nodes plus characters; the
    count stops past ``limit``, so a heavy value costs no more to look at than a light one."""
    weight, stack = 0, [value]
    while stack:
        item = stack.pop()
        weight += 1
        if isinstance(item, str):
            weight += len(item)
        elif isinstance(item, dict | list):
            if weight + len(item) > limit:  # before its children are walked
                return False
            if isinstance(item, dict):
                weight += sum(len(key) for key in item)
                stack.extend(item.values())
            else:
                stack.extend(item)
        if weight > limit:
            return False
    return True
