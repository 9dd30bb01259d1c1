"""uvicorn's own h11 protocol behind a ``ConnectionGate`` (``runner.telemetry.connections``), with a
timeout on each request's head; uvicorn's ``timeout_keep_alive`` is the idle timeout."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from runner.telemetry.connections import ConnectionGate, reset, unread


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
            self._await_head()  # the next request's head (a pipelined one stops it at once)
        super().on_response_complete()

    def _peer(self) -> tuple[str, int]:
        return self.client or ("", id(self))

    def _await_head(self) -> None:
        self._head_timer = self.loop.call_later(self._gate.limits.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            reset(self.transport)()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def gated_h11(gate: ConnectionGate) -> type[GatedH11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for one listener."""
    return type("GatedH11Protocol", (GatedH11Protocol,), {"gate": gate})
