"""A per-tool circuit breaker: closed, open, half-open with exactly one probe.

Closed counts consecutive failed calls; at ``failure_threshold`` it opens. Open refuses
every call until ``reset_timeout`` has passed; then the first call through is the one
probe (half-open) and every other call is refused until the probe ends. A successful
probe closes the breaker, a failed one opens it again, and a probe that ends without a
verdict (a runner fault, a cancelled call, an outcome that says nothing about the tool)
hands the probe back: the next call probes.

The protocol is one construct, so admission and verdict cannot be mispaired::

    with breaker.guard(ends_by=deadline) as ticket:   # raises CircuitOpen when refused
        execution = ...
        ticket.record(tool_verdict(execution.error))      # None, or never called: not counted
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from runner.clock import Clock
from runner.errors import CallError, ErrorCode, rule_of

# The least ``retry_after_ms`` a refusal says: never 0, which would invite a caller to
# come back at once, into the same refusal.
MIN_RETRY_AFTER_MS = 1


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitOpen(Exception):
    """The breaker refused a call; come back in ``retry_after_ms`` (always at least 1)."""

    def __init__(self, retry_after_ms: int, state: BreakerState) -> None:
        super().__init__(f"circuit {state.value}; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms
        self.state = state


def tool_verdict(error: CallError | None) -> bool | None:
    """What a call's end says of its tool: it works (True), it failed (False), or nothing
    (None: not counted). ``RETRY_EXHAUSTED`` is judged by its last attempt's error."""
    if error is None:
        return True
    code, reason = error.code, error.reason
    if code is ErrorCode.RETRY_EXHAUSTED:
        last = error.details.get("lastError")
        details = last.get("details") if isinstance(last, dict) else None
        code = ErrorCode.EXECUTION_ERROR  # judged by the last attempt's reason (counted if none)
        reason = details.get("reason") if isinstance(details, dict) else None
    return False if rule_of(code, reason).counted else None


@dataclass(eq=False)
class Ticket:
    """One admitted call. Its verdict is applied when the ``guard`` block ends."""

    probe: bool
    verdict: bool | None = None

    def record(self, verdict: bool | None) -> None:
        """The tool worked (True), failed (False), or the call says nothing of it (None)."""
        self.verdict = verdict


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int,
        reset_timeout_s: float,
        clock: Clock,
        on_open: Callable[[int], None] | None = None,
    ) -> None:
        """``on_open(failures)`` is called, outside the breaker's lock, each time it opens."""
        self._threshold = failure_threshold
        self._on_open = on_open
        self._reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._lock = threading.Lock()  # one Runner may be driven from several threads
        self._open = False
        self._failures = 0
        self._opened_at = 0.0
        self._probe: Ticket | None = None
        self._probe_ends_by = 0.0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state()

    @contextmanager
    def guard(self, ends_by: float) -> Iterator[Ticket]:
        """Admit one call for the length of the ``with`` block.

        ``ends_by`` is the clock time by which the call will have ended (its deadline):
        while it is the half-open probe, refused callers are told to come back then.
        The ticket's verdict, if any, is applied on leaving the block, whatever ends it;
        without one (an exception, a cancellation, ``record`` never called or given None)
        the call is not counted and a probe is handed back.

        Raises:
            CircuitOpen: the breaker is open, or half-open with its probe out.
        """
        ticket = self._admit(ends_by)
        try:
            yield ticket
        finally:
            opened = self._settle(ticket)
            if opened and self._on_open is not None:
                self._on_open(self._threshold if not ticket.probe else 1)

    def _state(self) -> BreakerState:
        if not self._open:
            return BreakerState.CLOSED
        return BreakerState.HALF_OPEN if self._probe is not None else BreakerState.OPEN

    def _admit(self, ends_by: float) -> Ticket:
        with self._lock:
            if not self._open:
                return Ticket(probe=False)
            now = self._clock.monotonic()
            if self._probe is not None:
                # The probe answers by its deadline at the latest; its teardown may take a
                # moment longer, so the hint is a lower bound.
                raise CircuitOpen(_ms(self._probe_ends_by - now), BreakerState.HALF_OPEN)
            left = self._reset_timeout_s - (now - self._opened_at)
            if left > 0:
                raise CircuitOpen(_ms(left), BreakerState.OPEN)
            self._probe = Ticket(probe=True)
            self._probe_ends_by = ends_by
            return self._probe

    def _settle(self, ticket: Ticket) -> bool:
        """Apply the ticket's verdict; whether that opened the breaker (again)."""
        with self._lock:
            if ticket is self._probe:
                self._probe = None
                if ticket.verdict is None:
                    return False  # still open, opened_at unchanged: the next call probes
            if ticket.verdict is None:
                return False
            if ticket.verdict:
                # Any success closes it: the tool works (a late one from before it opened too).
                self._open = False
                self._failures = 0
                return False
            self._failures += 1
            if ticket.probe or (not self._open and self._failures >= self._threshold):
                self._open = True
                self._opened_at = self._clock.monotonic()
                return True
            return False


def _ms(seconds: float) -> int:
    return max(MIN_RETRY_AFTER_MS, math.ceil(seconds * 1000))
