"""A tool-reported error: the ``{"error": {...}}`` document of a failing tool.

A tool that exits non-zero and prints exactly this on stdout reported an error of its own::

    {"error": {"message": "no weather data for 'Atlantis'",   # required, a string
               "code": "NOT_FOUND",                           # optional, a short word
               "retryable": false,                            # optional, a boolean
               "details": {"city": "Atlantis"}}}              # optional, an object

The document is read strictly and as a whole: the top level holds only ``error``, which
holds only those four keys, each of its type, and a non-empty message. Anything else is
not a tool error at all (the attempt stays a plain ``exit_code`` failure, whose details
say what was wrong with the document): a tool that cannot spell its error document is
not trusted to say whether to retry. Values of the right type are bounded, not refused:
the message is made one printable line of at most ``MAX_MESSAGE`` characters; ``details``
larger than ``MAX_DETAILS_BYTES`` or deeper than ``MAX_DETAILS_DEPTH`` is left out (with
a note why), and its strings are made printable.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from runner.schema import strict_json

MAX_MESSAGE = 300
MAX_DETAILS_BYTES = 4096
MAX_DETAILS_DEPTH = 8
# A machine-readable word: NOT_FOUND, rate-limited, http.404.
CODE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_KEYS = frozenset({"message", "code", "retryable", "details"})


@dataclass(frozen=True)
class ToolReport:
    """What the tool said about its own failure, bounded."""

    message: str
    code: str | None
    retryable: bool
    details: dict[str, Any] | None
    details_omitted: str | None = None  # why ``details`` was left out


@dataclass(frozen=True)
class NotAReport:
    """stdout tried to be an error document (an object with ``error``) but is not one."""

    problem: str


def printable(text: str) -> str:
    """``text`` without control or format characters (each becomes a space)."""
    return "".join(" " if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch for ch in text)


def one_line(text: str, limit: int) -> str:
    """Printable, whitespace collapsed, at most ``limit`` characters (then ``...``)."""
    text = " ".join(printable(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def read_report(stdout: bytes) -> ToolReport | NotAReport | None:
    """The error document on a failing tool's stdout: a report, a broken attempt at one,
    or None when stdout is no attempt at all (not a JSON object with an ``error`` key)."""
    try:
        document = strict_json.loads(stdout)
    except strict_json.JsonProblem:
        return None
    if not isinstance(document, dict) or "error" not in document:
        return None
    if len(document) != 1:
        return NotAReport("the error document has keys besides error")
    error = document["error"]
    if not isinstance(error, dict):
        return NotAReport("error must be an object")
    if unknown := sorted(set(error) - _KEYS):
        return NotAReport(f"error has unknown keys: {', '.join(unknown)}"[:200])
    message, code = error.get("message"), error.get("code")
    retryable, details = error.get("retryable", False), error.get("details")
    if not isinstance(message, str) or not message.strip():
        return NotAReport("error.message must be a non-empty string")
    if code is not None and not (isinstance(code, str) and CODE_PATTERN.fullmatch(code)):
        return NotAReport(f"error.code must be a string matching {CODE_PATTERN.pattern}")
    if not isinstance(retryable, bool):
        return NotAReport("error.retryable must be a boolean")
    if details is not None and not isinstance(details, dict):
        return NotAReport("error.details must be an object")
    kept, omitted = _bounded(details)
    return ToolReport(one_line(message, MAX_MESSAGE), code, retryable, kept, omitted)


def _bounded(details: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    if details is None:
        return None, None
    if strict_json.depth(details, MAX_DETAILS_DEPTH) > MAX_DETAILS_DEPTH:
        return None, f"deeper than {MAX_DETAILS_DEPTH} levels"
    clean = _printable_strings(details)
    size = len(json.dumps(clean, ensure_ascii=False, separators=(",", ":")).encode())
    if size > MAX_DETAILS_BYTES:
        return None, f"larger than {MAX_DETAILS_BYTES} bytes"
    return clean, None


def _printable_strings(value: Any) -> Any:
    """``value`` with every string in it (keys too) made printable; depth is bounded above."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(key): _printable_strings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_printable_strings(item) for item in value]
    return value
