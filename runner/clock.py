"""Injectable time, so retry, deadline and breaker tests need not sleep."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Protocol


def iso_now() -> str:
    """The wall clock as audit events and answers write it: UTC, milliseconds, ``Z``."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
