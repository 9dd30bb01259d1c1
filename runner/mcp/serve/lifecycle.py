"""Running the server: its transport, the watcher, and the signals.

SIGTERM (and SIGINT) drain: new calls are refused, calls in flight end (each by its own
deadline), then the transport stops, the runner closes (no sandbox left) and the process
exits 0. SIGHUP reloads the policy and the tools at once.
"""

from __future__ import annotations

import signal
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from runner.mcp.serve.app import ToolService
from runner.mcp.serve.reload import Reloader

# After a drain, how long the transport may take to send the last answers and return
# before it is cancelled.
STOP_GRACE_S = 5.0


class Transport(Protocol):
    async def serve(self) -> None:
        """Serve until the clients are gone or ``stop`` was called."""

    def stop(self) -> None:
        """Stop taking requests; ``serve`` returns once the answers in hand are sent."""


async def run_until_stopped(service: ToolService, reloader: Reloader, transport: Transport) -> None:
    """Serve ``transport`` with the watcher until it ends or a signal stops it; then close
    the runner."""
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_on_signals, service, reloader, transport, tasks)
            tasks.start_soon(reloader.watch)
            await transport.serve()  # the client went away (stdio: end of input), or a stop
            tasks.cancel_scope.cancel()
    finally:
        service.close()
        with anyio.CancelScope(shield=True):
            try:
                await service.sessions.end_all()  # their MCP sessions end with the server
            finally:
                await service.runner.aclose()


async def _on_signals(
    service: ToolService, reloader: Reloader, transport: Transport, tasks: TaskGroup
) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for received in signals:
            if received == signal.SIGHUP:
                await reloader.reload()
                continue
            await service.drain()
            transport.stop()
            await anyio.sleep(STOP_GRACE_S)
            tasks.cancel_scope.cancel()
            return
