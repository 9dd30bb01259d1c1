"""uvicorn's own h11 protocol behind a ``ConnectionGate`` (``runner.telemetry.connections``), with a
timeout on each request's head; uvicorn's ``timeout_keep_alive`` is the idle timeout."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from runner.telemetry.connections import ConnectionGate, reset, unread

# uvicorn's own log lines (a request it cannot parse, a traceback): at most this many per
# window, so that no peer can make the operator's log grow without bound.
LOG_BURST = 20
LOG_WINDOW_S = 60.0


class GatedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol behind a ``ConnectionGate``, with a timeout on each request's
    head (uvicorn's ``timeout_keep_alive`` is the idle timeout between requests)."""

    gate: ConnectionGate  # set on the subclass ``gated_h11`` makes for one listener

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = self.gate
        self._head_timer: asyncio.TimerHandle | None = None
        self._admitted = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self._peer()
        if not self._gate.admit(peer, self, reset(transport), unread(transport)):
            reset(transport)()
            return
        self._admitted = True
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._admitted:
            self._gate.release(self._peer(), self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived
            self._stop_head_timer()
            if self._admitted:
                self._gate.busy(self._peer(), True)

    def on_response_complete(self) -> None:
        if self._admitted:
            self._gate.busy(self._peer(), False)
        if not self.transport.is_closing():
            self._stop_head_timer()
            # The next request's head: idle first (uvicorn closes the connection after
            # ``timeout_keep_alive``), then the head's own time.
            self._await_head(self._gate.limits.idle_timeout_s)
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers a request whose body it cannot parse (a malformed chunk) itself,
        # while the app may still answer it: that answer then met an ended response and
        # raised, a traceback in the log per request, which anyone could send. The app's
        # sends are dropped instead (as for a client that left).
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # not a finished earlier request's
            cycle.disconnected = True
            if cycle.response_started:  # too late for a 400: the connection just ends
                self.transport.close()
                return
        super().send_400_response(msg)

    def _peer(self) -> tuple[str, int]:
        return self.client or ("", id(self))

    def _await_head(self, idle_s: float = 0.0) -> None:
        self._head_timer = self.loop.call_later(idle_s + self._gate.limits.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            reset(self.transport)()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def gated_h11(gate: ConnectionGate) -> type[GatedH11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for one listener; uvicorn's
    own log is bounded from now on (``BoundedLog``)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(existing, BoundedLog) for existing in logger.filters):
        logger.addFilter(BoundedLog())
    return type("GatedH11Protocol", (GatedH11Protocol,), {"gate": gate})


class BoundedLog(logging.Filter):
    """uvicorn logs a line for each request it cannot parse or upgrade, whoever sends it:
    at most ``LOG_BURST`` lines per ``LOG_WINDOW_S`` of each level (warnings cannot crowd
    out errors), then the next line passed says how many were left out before it."""

    def __init__(self) -> None:
        super().__init__()
        self._windows: dict[int, list[float]] = {}  # level: [start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        window = self._windows.setdefault(record.levelno, [now, 0, 0])
        if now - window[0] >= LOG_WINDOW_S:
            if window[2]:
                record.msg = f"({int(window[2])} lines of this level left out before this one) {record.msg}"
            window[:] = [now, 0, 0]
        if window[1] >= LOG_BURST:
            window[2] += 1
            return False
        window[1] += 1
        return True
