"""Calls over time by outcome, and breaker openings, for ``runner audit report``.

Bounded like the rest of the report: at most ``MAX_BUCKETS`` time buckets, whatever the log
spans; when a new call falls outside them, the buckets are merged pairwise (twice as wide)
until it fits, so a year of calls costs what an hour does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from runner.audit.query import parse_time

OUTCOMES = ("success", "denied", "error", "cancelled")
MAX_BUCKETS = 512
FIRST_WIDTH_S = 60  # a minute: fine enough for a test run, merged for longer logs
DENIED_CODES = frozenset({"PERMISSION_DENIED", "TOOL_NOT_FOUND", "INVALID_REQUEST"})


def outcome_of(event: dict[str, Any]) -> str:
    """How a ``call.finished`` event ended, in one of ``OUTCOMES``."""
    if event.get("success") is True:
        return "success"
    if event.get("cancelled") is True:
        return "cancelled"
    return "denied" if event.get("code") in DENIED_CODES else "error"


@dataclass
class Timeline:
    """``call.finished`` counts per time bucket and outcome."""

    width_s: int = FIRST_WIDTH_S
    buckets: dict[int, Counter[str]] = field(default_factory=dict)  # bucket start (epoch s) -> counts

    def take(self, event: dict[str, Any]) -> None:
        when = parse_time(event.get("timestamp"))
        if when is None:
            return
        second = int(when.timestamp())
        while True:
            start = second - second % self.width_s
            if start in self.buckets or len(self.buckets) < MAX_BUCKETS:
                break
            self._widen()
        self.buckets.setdefault(start, Counter())[outcome_of(event)] += 1

    def _widen(self) -> None:
        self.width_s *= 2
        merged: dict[int, Counter[str]] = {}
        for start, counts in self.buckets.items():
            merged.setdefault(start - start % self.width_s, Counter()).update(counts)
        self.buckets = merged

    def as_json(self) -> dict[str, Any]:
        return {
            "bucketSeconds": self.width_s,
            "buckets": [
                {
                    "start": datetime.fromtimestamp(start, UTC).isoformat().replace("+00:00", "Z"),
                    **{outcome: self.buckets[start][outcome] for outcome in OUTCOMES},
                }
                for start in sorted(self.buckets)
            ],
        }
