"""``runner audit report``: per tool, role or client, what the calls did.

Counted from two events per call: ``policy.decision`` (denials by reason) and
``call.finished`` (calls, successes, cancellations, errors by code and reason, duration).
A denied call also ends in a failed ``call.finished`` (``PERMISSION_DENIED``, or
``TOOL_NOT_FOUND``/``INVALID_REQUEST`` when refused before the policy), so it counts under
its denial reason and under its error code: ``errors`` says how calls ended, ``denials``
what the policy said.

The file is streamed with bounded memory: each line is bounded (``MAX_LINE_BYTES``), lines
that are neither a call's end nor a denial are skipped before parsing, durations go into a
``DurationHistogram`` (a fixed set of buckets, not the values), past ``MAX_GROUPS``
groups the rest are counted together under ``OTHER``, and every group name, code and reason
is cut to ``MAX_KEY_CHARS``.

In a hash-chained log (one with a line that ends in a ``hash``) only chained lines are
counted: unchained ones (forged, or from before ``chain`` was turned on) are skipped and
counted apart. Whether the chained lines are intact is ``runner audit verify``'s question.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from runner.audit import chain as audit_chain
from runner.audit.query import bounded_lines, parse_time
from runner.audit.timeline import Timeline

GroupBy = Literal["tool", "role", "client", "session"]
GROUP_FIELDS: dict[str, str] = {
    "tool": "toolName",
    "role": "role",
    "client": "client",
    "session": "sessionId",
}
MAX_LINE_BYTES = 1 << 20  # far above any line the runner writes; a longer one is skipped
MAX_GROUPS = 10_000  # tool names of refused calls are logged as sent: a caller could invent many
MAX_KEYS = 1000  # distinct reasons (or codes) kept per count; a foreign file may hold any
OTHER = "(other)"
MAX_KEY_CHARS = 256  # a group name, code or reason is cut to this (a foreign line may hold 1 MiB)
CUT = "...(cut)"
NONE = "-"  # the group of events without the field (a call not served over HTTP has no client)
EXACT_BELOW_MS = 1000  # durations below this are counted exactly, per millisecond
BUCKET_RATIO = 1.01  # above it, buckets 1% wide: a percentile is within 0.5% of the true value
_LOG_RATIO = math.log(BUCKET_RATIO)
# Only these lines are parsed: a call's end, a denial (an allow adds nothing to count), a
# breaker opening.
_FINISHED, _DECISION, _DENY, _OPENED = b"call.finished", b"policy.decision", b"deny", b"breaker.opened"
_COUNTED = ("call.finished", "policy.decision", "breaker.opened")
_DECODER = json.JSONDecoder()


class DurationHistogram:
    """Durations in milliseconds: exact below ``EXACT_BELOW_MS``, above it in buckets
    ``BUCKET_RATIO`` wide, a percentile reported as its bucket's geometric middle (within
    0.5%). At most about 1,000 + 230 per decade of buckets, whatever the count of values."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self.count = 0

    def add(self, duration_ms: float) -> None:
        self._counts[_bucket(max(duration_ms, 0.0))] += 1
        self.count += 1

    def merge(self, other: DurationHistogram) -> None:
        self._counts.update(other._counts)
        self.count += other.count

    def percentile(self, fraction: float) -> float | None:
        """The nearest-rank percentile (the smallest value with ``fraction`` of all at or below
        it), or None when empty."""
        if not self.count:
            return None
        rank = max(math.ceil(fraction * self.count), 1)
        seen = 0
        for bucket in sorted(self._counts):
            seen += self._counts[bucket]
            if seen >= rank:
                return _value(bucket)
        return None  # not reached: the counts add up to self.count


def _bucket(duration_ms: float) -> int:
    if duration_ms < EXACT_BELOW_MS:
        return round(duration_ms)
    return EXACT_BELOW_MS + int(math.log(duration_ms / EXACT_BELOW_MS) / _LOG_RATIO)


def _value(bucket: int) -> float:
    if bucket < EXACT_BELOW_MS:
        return float(bucket)
    low = EXACT_BELOW_MS * BUCKET_RATIO ** (bucket - EXACT_BELOW_MS)
    return round(low * math.sqrt(BUCKET_RATIO), 1)


@dataclass
class GroupStats:
    calls: int = 0
    successes: int = 0
    cancelled: int = 0
    denials: Counter[str] = field(default_factory=Counter)
    errors: dict[str, Counter[str]] = field(default_factory=dict)  # code -> reason -> count
    durations: DurationHistogram = field(default_factory=DurationHistogram)

    def take(self, event: dict[str, Any]) -> None:
        if event.get("event") == "policy.decision":
            if event.get("decision") == "deny":
                _count(self.denials, event.get("reason"))
            return
        self.calls += 1
        duration = event.get("duration")
        if isinstance(duration, int | float) and not isinstance(duration, bool) and math.isfinite(duration):
            self.durations.add(duration)
        if event.get("success") is True:
            self.successes += 1
        elif event.get("cancelled") is True:
            self.cancelled += 1
        else:
            code = _text(event.get("code"))
            if code not in self.errors and len(self.errors) >= MAX_KEYS:
                code = OTHER
            _count(self.errors.setdefault(code, Counter()), event.get("reason"))

    def merge(self, other: GroupStats) -> None:
        self.calls += other.calls
        self.successes += other.successes
        self.cancelled += other.cancelled
        self.denials.update(other.denials)
        for code, reasons in other.errors.items():
            self.errors.setdefault(code, Counter()).update(reasons)
        self.durations.merge(other.durations)

    def as_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "successes": self.successes,
            "cancelled": self.cancelled,
            "denials": dict(self.denials.most_common()),
            "errors": {code: dict(reasons.most_common()) for code, reasons in sorted(self.errors.items())},
            "durationMs": {"p50": self.durations.percentile(0.5), "p95": self.durations.percentile(0.95)},
        }


def _text(value: object) -> str:
    if value is None:
        return NONE
    text = str(value)
    return text if len(text) <= MAX_KEY_CHARS else text[: MAX_KEY_CHARS - len(CUT)] + CUT


def _count(counter: Counter[str], value: object) -> None:
    key = _text(value)
    counter[key if key in counter or len(counter) < MAX_KEYS else OTHER] += 1


@dataclass
class AuditReport:
    by: GroupBy
    since: datetime | None = None
    groups: dict[str, GroupStats] = field(default_factory=dict)
    lines: int = 0
    skipped: int = 0  # lines that were candidates but not events (torn, foreign, too long)
    chained: bool = False  # a line of the log ends with a hash: only chained lines are counted
    unchained_skipped: int = 0  # in a chained log, the lines without chain fields (not counted)
    timeline: Timeline = field(default_factory=Timeline)
    breaker_openings: Counter[str] = field(default_factory=Counter)  # tool -> times opened

    def take(self, event: dict[str, Any]) -> None:
        if event.get("event") == "breaker.opened":
            _count(self.breaker_openings, event.get("toolName"))
            return
        if event.get("event") == "call.finished":
            self.timeline.take(event)
        name = _text(event.get(GROUP_FIELDS[self.by]))
        stats = self.groups.get(name)
        if stats is None:
            if len(self.groups) >= MAX_GROUPS:
                name = OTHER
            stats = self.groups.setdefault(name, GroupStats())
        stats.take(event)

    @property
    def total(self) -> GroupStats:
        """All groups together."""
        total = GroupStats()
        for stats in self.groups.values():
            total.merge(stats)
        return total

    def as_json(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "since": self.since.isoformat() if self.since else None,
            "chained": self.chained,
            "unchainedSkipped": self.unchained_skipped,
            "groups": [{"group": name, **stats.as_json()} for name, stats in self.sorted_groups()],
            "total": self.total.as_json(),
            "timeline": self.timeline.as_json(),
            "breakerOpenings": dict(self.breaker_openings.most_common()),
        }

    def sorted_groups(self) -> list[tuple[str, GroupStats]]:
        """Busiest first, then by name."""
        return sorted(self.groups.items(), key=lambda item: (-item[1].calls, item[0]))


def build_report(lines: Iterable[bytes | None], by: GroupBy, since: datetime | None = None) -> AuditReport:
    """The report of ``lines`` (None stands for a line too long to read). Unchained lines are
    counted apart until a chained line shows the log is chained; then they are dropped."""
    report = AuditReport(by, since)  # the chained lines
    plain = AuditReport(by, since)  # the unchained ones, while no line is chained
    unchained = 0
    for raw in lines:
        report.lines += 1
        if raw is None:
            report.skipped += 1
            continue
        if audit_chain.ends_chained(raw):
            report.chained = True
            target = report
        else:
            unchained += 1
            if report.chained:
                continue
            target = plain
        if _FINISHED not in raw and _OPENED not in raw and (_DECISION not in raw or _DENY not in raw):
            continue
        try:
            event = _DECODER.decode(raw.decode("utf-8", errors="replace"))
        except (ValueError, RecursionError):  # RecursionError: a foreign line nested too deep
            report.skipped += 1
            continue
        if not isinstance(event, dict) or event.get("event") not in _COUNTED:
            continue
        if since is not None:
            when = parse_time(event.get("timestamp"))
            if when is None or when < since:
                continue
        target.take(event)
    if report.chained:
        report.unchained_skipped = unchained
    else:
        report.groups = plain.groups
        report.timeline, report.breaker_openings = plain.timeline, plain.breaker_openings
    return report


def report_file(path: Path, by: GroupBy, since: datetime | None = None) -> AuditReport:
    """Raises ``OSError``: the log cannot be opened or read."""
    with path.open("rb") as stream:
        return build_report(bounded_lines(stream, MAX_LINE_BYTES), by, since)
