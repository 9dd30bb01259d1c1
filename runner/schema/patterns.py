"""Regular expressions from untrusted schemas, matched by RE2 in time linear in the input.

A backtracking engine (Python's ``re``) takes exponential time on patterns such as
``^(a+)+$``; RE2 has no backtracking, so it cannot be stalled, and it refuses what it
cannot match in linear time (lookarounds, backreferences) with an error instead.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Protocol, cast

import re2  # google-re2

MAX_PROGRAM_BYTES = 8 * 1024 * 1024  # RE2's own default; a pattern needing more is refused
# For the secrets of one request (see redaction). Small on purpose: the re2 module keeps
# the last 128 compiled patterns; larger sets are matched one literal at a time instead.
LITERALS_PROGRAM_BYTES = 1024 * 1024


class PatternError(ValueError):
    """A pattern RE2 cannot compile; the message says why."""


class Pattern(Protocol):
    def search(self, text: str) -> object | None: ...

    def sub(self, repl: str, text: str) -> str: ...


def _options(max_mem: int) -> object:
    options = re2.Options()
    options.log_errors = False  # RE2 would print every refused pattern on stderr
    options.max_mem = max_mem
    return options


@functools.lru_cache(maxsize=1024)
def compile_pattern(text: str) -> Pattern:
    """``text`` compiled by RE2 (cached).

    Raises:
        PatternError: RE2 cannot compile it.
    """
    try:
        return cast(Pattern, re2.compile(text, options=_options(MAX_PROGRAM_BYTES)))
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", errors="replace")
        raise PatternError(str(reason)) from exc


def search(pattern: str, text: str) -> bool:
    """Does ``pattern`` match anywhere in ``text`` (JSON Schema's unanchored ``pattern``)?

    Raises:
        PatternError: RE2 cannot compile the pattern.
    """
    return compile_pattern(pattern).search(text) is not None


def any_of_literals(words: Iterable[str]) -> Pattern:
    """One pattern matching any of ``words`` literally, the longest first where they overlap.

    Raises:
        PatternError: too large for RE2 (the caller then matches them one by one).
    """
    ordered = sorted(set(words), key=lambda word: (-len(word), word))
    text = "|".join(re2.escape(word) for word in ordered)
    try:
        return cast(Pattern, re2.compile(text, options=_options(LITERALS_PROGRAM_BYTES)))
    except re2.error as exc:
        raise PatternError("too many or too long literals") from exc
