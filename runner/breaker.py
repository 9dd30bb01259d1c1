"""A per-tool circuit breaker: closed, open, half-open with exactly one probe.

Closed counts consecutive failed calls; at ``failure_threshold`` it opens. Open refuses
every call until ``reset_timeout`` has passed; then the first call through is the one
probe (half-open) and every other call is refused until the probe ends. A successful
probe closes the breaker, a failed one opens it again.
"""

from __future__ import annotations

import enum
import threading

from runner.clock import Clock


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int, reset_timeout_s: float, clock: Clock) -> None:
        self._threshold = failure_threshold
        self._reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._lock = threading.Lock()  # one Runner may be driven from several threads
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def acquire(self) -> bool:
        """May a call go through now? True obliges the caller to ``record`` its end."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.HALF_OPEN:
                return False  # the probe is still out
            if self._clock.monotonic() - self._opened_at < self._reset_timeout_s:
                return False
            self._state = BreakerState.HALF_OPEN
            return True

    def record(self, success: bool) -> None:
        with self._lock:
            if success:
                self._state = BreakerState.CLOSED
                self._failures = 0
                return
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or self._failures >= self._threshold:
                self._state = BreakerState.OPEN
                self._opened_at = self._clock.monotonic()

    def release(self) -> None:
        """End a call without a verdict: a half-open breaker waits for another probe."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._state = BreakerState.OPEN  # opened_at unchanged: the next call probes

    def retry_after_ms(self) -> int:
        with self._lock:
            left = self._reset_timeout_s - (self._clock.monotonic() - self._opened_at)
            return max(0, round(left * 1000))
