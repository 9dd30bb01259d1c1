"""Strict JSON at the edges: no NaN or Infinity (RFC 8259 has neither), bounded nesting.

Python's ``json`` accepts ``NaN``, ``Infinity`` and numbers that overflow to infinity
(``1e999``) and writes them back as non-JSON; the runner refuses them on the way in
(``INVALID_PARAMS``) and out (``PARSE_ERROR``), and every document it writes is dumped
with ``allow_nan=False``.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64  # params and results alike; validation and dumping recurse per level


class JsonProblem(ValueError):
    """Text that is not one strict JSON document within the bounds; the message says why."""


def _no_constant(name: str) -> Any:
    raise JsonProblem(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonProblem(f"number {text[:40]} overflows")
    return value


def depth(value: object, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a JSON value, counted without recursion and stopping past ``limit``."""
    deepest, stack = 1, [(value, 1)]
    while stack and deepest <= limit:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children:  # a leaf counts one level; only containers are walked (millions of leaves are quick)
            deepest = max(deepest, level + 1)
            stack.extend((v, level + 1) for v in children if isinstance(v, dict | list))
    return deepest


def loads(data: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """One strict JSON document.

    Raises:
        JsonProblem: not JSON, not UTF-8, NaN/Infinity or an overflowing number, or
            nested deeper than ``max_depth``.
    """
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
    except JsonProblem:
        raise
    except RecursionError as exc:
        raise JsonProblem(f"nested deeper than {max_depth} levels") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise JsonProblem(" ".join(str(exc).split())) from exc
    if depth(value, max_depth) > max_depth:
        raise JsonProblem(f"nested deeper than {max_depth} levels")
    return value
