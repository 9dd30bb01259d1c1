"""A served call's events on their way to its client, while the tool runs.

The tool's progress goes out as ``notifications/progress`` when the client gave a
``progressToken`` (until it first does, a heartbeat says the call is alive, once a
second); its logs as ``notifications/message`` at or above the level the client set with
``logging/setLevel`` (every level until it sets one). Content blocks travel in the
result (``runner.mcp.serve.app``), not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
import weakref
from typing import Any

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPDeprecationWarning

from runner.call.events import LOG_LEVELS, Event

# A call that runs longer than this gets progress notifications (when the client sent a
# progressToken), one per interval, until the tool reports progress of its own.
PROGRESS_INTERVAL_S = 1.0
# A heartbeat's progress per second of the call: far below what a tool reports, so that
# the tool's own values, once they come, go out as they are and still go forward.
HEARTBEAT_UNIT = 1e-6


def _connection(ctx: ServerRequestContext[Any, Any]) -> object:
    # The SDK hands the connection to handlers only through the request's session.
    return ctx.session._connection


class LogLevels:
    """The level each client connection set with ``logging/setLevel``."""

    def __init__(self) -> None:
        self._levels: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    async def set_level(
        self, ctx: ServerRequestContext[Any, Any], params: types.SetLevelRequestParams
    ) -> types.EmptyResult:
        self._levels[_connection(ctx)] = LOG_LEVELS.index(params.level)
        return types.EmptyResult()

    def allows(self, ctx: ServerRequestContext[Any, Any], level: str) -> bool:
        return LOG_LEVELS.index(level) >= self._levels.get(_connection(ctx), 0)


class EventRelay:
    """One call's events, queued as the runner hands them on (``heard``, on the call's
    loop) and sent in order by ``pump``; ``finish`` sends what is left."""

    def __init__(
        self, ctx: ServerRequestContext[Any, Any], tool_name: str, wants_progress: bool, levels: LogLevels
    ) -> None:
        self._ctx = ctx
        self._tool_name = tool_name
        self._wants_progress = wants_progress
        self._levels = levels
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._heartbeat = anyio.CancelScope()
        self._last_progress = -1.0
        self._beating = True  # until the tool's own progress
        self._pumped = anyio.Event()

    def heard(self, event: Event) -> None:
        """The runner's ``on_event``: never blocks."""
        if "progress" in event and not self._wants_progress:
            return
        if "log" in event and not self._levels.allows(self._ctx, event["log"]):
            return
        if "content" not in event:
            self._queue.put_nowait(event)

    async def heartbeat(self) -> None:
        """Progress by the clock, until the tool's own comes."""
        if not self._wants_progress:
            return
        started = time.monotonic()
        with self._heartbeat:
            while True:
                await anyio.sleep(PROGRESS_INTERVAL_S)
                elapsed = round(time.monotonic() - started, 1)
                message = f"{self._tool_name} running for {elapsed:g} s"
                await self._progress(elapsed * HEARTBEAT_UNIT, None, message)

    async def pump(self) -> None:
        """Send the queued events in order, until ``finish``."""
        try:
            while (event := await self._queue.get()) is not None:
                await self._send(event)
        finally:
            self._pumped.set()

    async def finish(self) -> None:
        """Send what is still queued (before the result goes out)."""
        self._queue.put_nowait(None)
        await self._pumped.wait()

    async def _send(self, event: Event) -> None:
        # A client that is gone gets nothing: its call is cancelled by the disconnect watch.
        with contextlib.suppress(Exception):
            if "progress" in event:
                self._heartbeat.cancel()
                done = event["progress"]
                if self._beating and done <= self._last_progress:  # a 0 after heartbeats
                    done = self._last_progress + HEARTBEAT_UNIT
                self._beating = False
                await self._progress(done, event.get("total"), event.get("message"))
            else:
                with warnings.catch_warnings():
                    # Deprecated by the 2026-07-28 protocol, still the way for clients before it.
                    warnings.simplefilter("ignore", MCPDeprecationWarning)
                    sending = self._ctx.session.send_log_message(
                        event["log"],
                        event["data"],
                        event.get("logger"),
                        related_request_id=self._ctx.request_id,
                    )
                await sending

    async def _progress(self, done: float, total: float | None, message: str | None) -> None:
        if done <= self._last_progress:  # a client sees progress only go forward
            return
        self._last_progress = done
        await self._ctx.session.report_progress(done, total, message)
