"""Reading the audit log back: streamed, filtered, tolerant of a half-written last line."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from runner.schema import strict_json


@dataclass(frozen=True)
class AuditFilter:
    request_id: str | None = None
    tool: str | None = None
    role: str | None = None
    decision: str | None = None
    code: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def matches(self, event: dict[str, Any]) -> bool:
        if self.request_id is not None and not str(event.get("requestId", "")).startswith(self.request_id):
            return False  # a prefix is enough, as with git's hashes
        pairs = (
            (self.tool, "toolName"),
            (self.role, "role"),
            (self.decision, "decision"),
            (self.code, "code"),
        )
        if any(wanted is not None and event.get(key) != wanted for wanted, key in pairs):
            return False
        if self.since is None and self.until is None:
            return True
        when = parse_time(event.get("timestamp"))
        if when is None:
            return False
        return (self.since is None or when >= self.since) and (self.until is None or when <= self.until)


def parse_time(value: object) -> datetime | None:
    """An ISO 8601 time; naive times are taken as UTC."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        from datetime import UTC

        when = when.replace(tzinfo=UTC)
    return when


def read_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Every well-formed event; a torn or foreign line is skipped, not fatal."""
    for line in lines:
        try:
            # Strict: a foreign line with NaN or deep nesting is skipped, not printed or fatal.
            event = strict_json.loads(line, max_depth=2 * strict_json.MAX_DEPTH)
        except strict_json.JsonProblem:
            continue
        if isinstance(event, dict) and "event" in event:
            yield event


def bounded_lines(stream: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """Each line of ``stream`` (its newline kept; the last may lack one), or None for a line
    longer than ``limit`` bytes, which is skipped without being held."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of the long line
            line = stream.readline(limit + 1)
        yield None


def query(path: Path, wanted: AuditFilter) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8", errors="replace") as log:
        yield from (event for event in read_events(log) if wanted.matches(event))


TABLE_COLUMNS = (
    ("timestamp", 24),
    ("event", 16),
    ("requestId", 28),
    ("toolName", 16),
    ("role", 8),
    ("outcome", 0),
)


def outcome(event: dict[str, Any]) -> str:
    if "decision" in event:
        rule = f" ({event.get('reason')})" if event.get("reason") else ""
        return f"{event['decision']}{rule}"
    cancelled = event.get("cancelled") is True
    if event.get("event") == "call.attempt":
        ending = event.get("reason") or ("cancelled" if cancelled else "ok")
        return f"attempt {event.get('attempt')}: {ending} {event.get('duration')}ms"
    if "success" in event:
        # A cancelled call has no error code: say what happened rather than print None.
        state = "success" if event["success"] else "cancelled" if cancelled else event.get("code") or "failed"
        return f"{state} attempts={event.get('attempts')} {event.get('duration')}ms"
    return ""


# Unicode categories a terminal acts on instead of printing: controls (C0, DEL, C1: ESC
# clears screens and moves the cursor), format characters (bidi overrides and isolates
# reorder what follows), line and paragraph separators, lone surrogates.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _escape_char(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if unicodedata.category(char) not in _UNPRINTABLE:
        return char
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def escape_cell(value: str) -> str:
    """``value`` as inert text: every character a terminal would act on, and the backslash,
    written as a Python-style escape (``\\x1b``, ``\\u202e``, ``\\\\``)."""
    return "".join(_escape_char(char) for char in value)


def write_table(events: Iterable[dict[str, Any]], out: TextIO) -> int:
    def line(cells: dict[str, str]) -> str:
        return " ".join(
            cells[name][: width - 1].ljust(width) if width else cells[name] for name, width in TABLE_COLUMNS
        )

    out.write(line({name: name for name, _ in TABLE_COLUMNS}) + "\n")
    count = 0
    for event in events:
        # Every value comes from the log, and a refused request's ids are logged as sent.
        cells = {name: escape_cell(str(event.get(name) or "-")) for name, _ in TABLE_COLUMNS}
        cells["outcome"] = escape_cell(outcome(event))
        out.write(line(cells) + "\n")
        count += 1
    return count
