""" "Did you mean": the closest valid names to a mistyped one.

Used wherever a person types a name the runner must look up: a key of a manifest or the
policy, a JSON Schema type, a tool's name. Only names the asker may already see are offered.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic_core import ErrorDetails

CLOSE_ENOUGH = 0.6  # difflib's ratio: "limts" ~ "limits", "strng" ~ "string", not "cpu" ~ "env"
MAX_OFFERED = 3


def closest(word: str, choices: Iterable[str]) -> list[str]:
    """The valid names closest to ``word``, best first (none when nothing is close)."""
    return difflib.get_close_matches(word, sorted(set(choices)), n=MAX_OFFERED, cutoff=CLOSE_ENOUGH)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean X?)"``, ``" (did you mean X or Y?)"``, or ``""``."""
    found = closest(word, choices)
    if not found:
        return ""
    if len(found) == 1:
        return f" (did you mean {found[0]}?)"
    return f" (did you mean {', '.join(found[:-1])} or {found[-1]}?)"


def pydantic_problem(error: ErrorDetails, model: type[BaseModel]) -> str:
    """One pydantic error as ``where: what``, with the closest valid key for an unknown one."""
    loc = error["loc"]
    where = ".".join(str(part) for part in loc) or "(root)"
    message = error["msg"]
    if error["type"] == "extra_forbidden" and loc:
        message += did_you_mean(str(loc[-1]), _keys_at(model, loc[:-1]))
    return f"{where}: {message}"


def _keys_at(model: type[BaseModel], path: tuple[int | str, ...]) -> set[str]:
    """The keys a mapping at ``path`` under ``model`` may have (empty when unknown)."""
    kinds: list[Any] = [model]
    for part in path:
        kinds = [inner for kind in kinds for inner in _inside(kind, part)]
    keys: set[str] = set()
    for kind in kinds:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys.update(info.alias or name for name, info in kind.model_fields.items())
    return keys


def _inside(kind: Any, part: int | str) -> list[Any]:
    """What sits at ``part`` of a value of type ``kind``: a model's field, a list's item, a
    dict's value; a union is each of its members."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        args = typing.get_args(kind)
        members = args[:1] if origin is typing.Annotated else args
        return [inner for member in members for inner in _inside(member, part)]
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        by_alias = {info.alias or name: info for name, info in kind.model_fields.items()}
        info = by_alias.get(str(part))
        return [info.annotation] if info is not None else []
    if origin in (list, tuple, set, frozenset) and isinstance(part, int):
        return list(typing.get_args(kind)[:1])
    if origin is dict:
        args = typing.get_args(kind)
        return [args[1]] if len(args) == 2 else []
    return []
