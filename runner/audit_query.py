"""Reading the audit log back: streamed, filtered, tolerant of a half-written last line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO


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
        pairs = (
            (self.request_id, "requestId"),
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
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            yield event


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


def _outcome(event: dict[str, Any]) -> str:
    if "decision" in event:
        rule = f" ({event.get('reason')})" if event.get("reason") else ""
        return f"{event['decision']}{rule}"
    if event.get("event") == "call.attempt":
        return f"attempt {event.get('attempt')}: {event.get('reason') or 'ok'} {event.get('duration')}ms"
    if "success" in event:
        state = "success" if event["success"] else event.get("code")
        return f"{state} attempts={event.get('attempts')} {event.get('duration')}ms"
    return ""


def write_table(events: Iterable[dict[str, Any]], out: TextIO) -> int:
    def line(cells: dict[str, str]) -> str:
        return " ".join(
            cells[name][: width - 1].ljust(width) if width else cells[name] for name, width in TABLE_COLUMNS
        )

    out.write(line({name: name for name, _ in TABLE_COLUMNS}) + "\n")
    count = 0
    for event in events:
        cells = {name: str(event.get(name) or "-") for name, _ in TABLE_COLUMNS}
        cells["outcome"] = _outcome(event)
        out.write(line(cells) + "\n")
        count += 1
    return count
