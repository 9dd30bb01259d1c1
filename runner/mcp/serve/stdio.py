"""``runner serve --stdio``: MCP over standard input and output.

The SDK's ``stdio_server`` reads standard input in a worker thread that cannot be
cancelled, so a server told to stop (SIGTERM) would wait for its client's next line. Here
standard input is read on the event loop instead (a pipe, as an MCP client spawns us
with), which a stop cancels at once; standard output is still the SDK's.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from typing import Any

from mcp.server.stdio import stdio_server

from runner.mcp.serve.app import ToolService

# The longest request line read; one past it is answered as a parse error. Params are
# bounded at 8 MiB (runner.call.requests), their JSON-RPC envelope adds little.
MAX_LINE_BYTES = 16 * 1024 * 1024
# Not JSON: what an overlong line is handed on as, so that the SDK reports a parse error.
_UNPARSABLE = "\x00\n"


class _LoopStdin:
    """Standard input as text lines, read without a thread (``async for line in stdin``)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._reader: asyncio.StreamReader | None = None
        self._ended = False

    def end(self) -> None:
        """End the input here, as if the client had closed it: the server then finishes
        what it has in hand (answers sent) and returns."""
        self._ended = True
        if self._reader is not None:
            self._reader.feed_eof()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        reader = self._reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
        if self._ended:
            reader.feed_eof()
        pipe = os.fdopen(os.dup(self._fd), "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as end:
                    if end.partial:
                        yield end.partial.decode("utf-8", errors="replace")
                    return
                except asyncio.LimitOverrunError as overrun:
                    await _skip_line(reader, overrun.consumed)
                    yield _UNPARSABLE
                    continue
                yield line.decode("utf-8", errors="replace")
        finally:
            transport.close()


async def _skip_line(reader: asyncio.StreamReader, consumed: int) -> None:
    """Drop the rest of an overlong line, up to and including its newline."""
    await reader.readexactly(consumed)
    while True:
        try:
            await reader.readuntil(b"\n")
            return
        except asyncio.LimitOverrunError as more:
            await reader.readexactly(more.consumed)
        except asyncio.IncompleteReadError:
            return


def _stdin_is_a_stream() -> bool:
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


class StdioTransport:
    """One client on standard input and output; ``stop`` ends the input (see ``_LoopStdin.end``)."""

    def __init__(self, service: ToolService) -> None:
        self._service = service
        # A regular file cannot be watched by the loop: the SDK's own reader serves it then.
        self._stdin = _LoopStdin(0) if _stdin_is_a_stream() else None

    async def serve(self) -> None:
        """Serve until the input ends."""
        server = self._service.server()
        stdin: Any = self._stdin
        async with stdio_server(stdin=stdin) as (read_stream, write_stream):
            await server.run(read_stream, write_stream, self._service.initialization_options(server))

    def stop(self) -> None:
        if self._stdin is not None:
            self._stdin.end()
