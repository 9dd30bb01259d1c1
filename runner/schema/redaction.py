"""Keeping secrets out of answers and audit events.

Two complementary rules. By place: a value the schema marks ``"x-sensitive": true`` is
written as ``***`` where it stands (``redact_nodes``, ``redact_params``). By value: every
sensitive string of the request is cut out of any text it turns up in, an error message
that quotes a parent object or a tool's stderr alike (``Scrubber``).
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from runner.schema.patterns import Pattern, PatternError, any_of_literals

REDACTED = "***"
# Up to this many secrets, str.replace one by one is as fast as one RE2 pass.
FEW_SECRETS = 16
# A sensitive number shorter than this (as digits) is no secret kept: masking every 7 or
# 42 would garble every message, and would drop every progress event and image.
MIN_NUMBER_SECRET = 3
# The secrets looked for in an image's, audio's or blob's data: a shorter one turns up in
# any few kilobytes of it by chance.
MIN_DATA_SECRET = 8


@dataclass(frozen=True)
class Scrubber:
    """The sensitive strings of one request, and the means to scrub them out of anything."""

    secrets: frozenset[str] = frozenset()

    @classmethod
    def of(cls, values: Iterable[object]) -> Scrubber:
        """A scrubber for every non-empty string and every number (by its JSON text) found
        in ``values``, nested ones included: a sensitive PIN is as secret as a password."""
        return cls(frozenset(text for text in sensitive_leaves(values) if text))

    def __bool__(self) -> bool:
        return bool(self.secrets)

    def merged(self, other: Scrubber) -> Scrubber:
        return Scrubber(self.secrets | other.secrets)

    @functools.cached_property
    def _ordered(self) -> tuple[str, ...]:
        # Longest first, so a secret that contains another is cut out whole.
        return tuple(sorted(self.secrets, key=lambda text: (-len(text), text)))

    @functools.cached_property
    def _pattern(self) -> Pattern | None:
        if len(self.secrets) <= FEW_SECRETS:
            return None
        try:
            return any_of_literals(self.secrets)
        except PatternError:
            return None

    def scrub_text(self, text: str) -> str:
        """``text`` with every occurrence of every secret replaced by ``***``."""
        if not self.secrets or not text:
            return text
        pattern = self._pattern
        if pattern is not None:
            return pattern.sub(REDACTED, text)
        for secret in self._ordered:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    def scrub_cut_text(self, text: str) -> str:
        """``scrub_text`` for text whose start may have been cut off (a stream's tail):
        a secret cut there leaves its end at the start, which is masked too."""
        if not self.secrets or not text:
            return text
        cut = max(_cut_fragment(secret, text) for secret in self.secrets)
        head = REDACTED if cut else ""
        return head + self.scrub_text(text[cut:])

    def scrub(self, value: Any, *, numbers: bool = False) -> Any:
        """``value`` with every string in it (mapping keys included) scrubbed; with
        ``numbers`` (a document a tool wrote), a number that spells a secret is ``***`` too;
        other values as is."""
        if not self.secrets:
            return value
        if isinstance(value, str):
            return self.scrub_text(value)
        if isinstance(value, Mapping):
            return {
                (self.scrub_text(key) if isinstance(key, str) else key): self.scrub(item, numbers=numbers)
                for key, item in value.items()
            }
        if isinstance(value, list | tuple):
            return [self.scrub(item, numbers=numbers) for item in value]
        return REDACTED if numbers and self.spelled_by(value) else value

    def found_in(self, text: str) -> bool:
        pattern = self._pattern
        if pattern is not None:
            return pattern.search(text) is not None
        return any(secret in text for secret in self.secrets)

    @functools.cached_property
    def _numeric(self) -> Scrubber:
        return Scrubber(frozenset(secret for secret in self.secrets if len(secret) >= MIN_NUMBER_SECRET))

    @functools.cached_property
    def _in_bytes(self) -> Scrubber:
        # Latin-1 maps each byte to one character: a secret's UTF-8 bytes are found in the
        # data's bytes as text, by one pattern.
        return Scrubber(
            frozenset(
                secret.encode("utf-8", "surrogatepass").decode("latin-1")
                for secret in self.secrets
                if len(secret) >= MIN_DATA_SECRET
            )
        )

    def spelled_by(self, value: object) -> bool:
        """Does a number's JSON text hold a secret (a secret of digits)?"""
        if not self.secrets or isinstance(value, str | Mapping | list | tuple):
            return False
        return self._numeric.found_in(json.dumps(value))

    def in_data(self, data: str) -> bool:
        """Does base64 ``data`` (checked valid) hold a secret, as its text or in the bytes it
        decodes to? Only secrets of ``MIN_DATA_SECRET`` characters or more are looked for."""
        look = self._in_bytes
        return bool(look) and (look.found_in(data) or look.found_in(base64.b64decode(data).decode("latin-1")))


NO_SECRETS = Scrubber()


def _cut_fragment(secret: str, text: str) -> int:
    """The length of the longest proper end of ``secret`` that ``text`` begins with."""
    first = text[:1]
    start = secret.find(first, 1)
    while start != -1:  # the first fit is the longest
        if text.startswith(secret[start:]):
            return len(secret) - start
        start = secret.find(first, start + 1)
    return 0


def sensitive_leaves(values: Iterable[object]) -> Iterable[str]:
    """Every string value in ``values`` and in the lists and mappings they hold (not keys),
    and every number's JSON text (and an integral float's integer), of ``MIN_NUMBER_SECRET``
    characters or more (not true or false)."""
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            # 48151623.0 is an integer to JSON Schema, which a tool may well print as such.
            spellings = {
                json.dumps(value),
                *([str(int(value))] if isinstance(value, float) and value.is_integer() else []),
            }
            yield from (text for text in spellings if len(text) >= MIN_NUMBER_SECRET)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)


def nodes_at(params: Mapping[str, Any], paths: Iterable[tuple[str, ...]]) -> list[object]:
    """The values of ``params`` found at ``paths`` (object keys, ``*`` for every array item)."""
    found: list[object] = []
    for path in paths:
        level: list[object] = [params]
        for step in path:
            following: list[object] = []
            for value in level:
                if step == "*" and isinstance(value, list):
                    following.extend(value)
                elif isinstance(value, Mapping) and step in value:
                    following.append(value[step])
            level = following
        found.extend(level)
    return found


def redact_nodes(value: Any, marked: frozenset[int]) -> Any:
    """``value`` with every node whose ``id`` is in ``marked`` replaced by ``***``.

    The ids are of objects inside ``value`` itself, found while validating it; the same
    object reached twice is redacted twice, which errs on the safe side.
    """
    if id(value) in marked:
        return REDACTED
    if isinstance(value, Mapping):
        return {key: redact_nodes(item, marked) for key, item in value.items()}
    if isinstance(value, list):
        return [redact_nodes(item, marked) for item in value]
    return value


def holds_marked(value: object, marked: frozenset[int]) -> bool:
    """Is ``value``, or anything inside it, one of the ``marked`` nodes?"""
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in marked:
            return True
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
