"""``runner serve --stdio``: MCP over standard input and output.

The SDK's ``stdio_server`` reads standard input in a worker thread that cannot be
cancelled, so a server told to stop (SIGTERM) would wait for its client's next line. Here
standard input is read on the event loop instead (a pipe, as an MCP client spawns us
with), which a stop cancels at once; standard output is still the SDK's.

A line that is not a JSON-RPC message is answered here, with JSON-RPC's parse error
(-32700, not JSON, or too long) or invalid request (-32600, with the line's ``id`` when it
has one a client could be waiting on): the SDK would hand its error to the server, which
answers nothing, and the client would wait for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import mcp_types as types
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

from runner.mcp.serve.app import ToolService

# The longest request line read; one past it is answered as a parse error. Params are
# bounded at 8 MiB (runner.call.requests), their JSON-RPC envelope adds little.
MAX_LINE_BYTES = 16 * 1024 * 1024
Answer = Callable[[types.JSONRPCError], Awaitable[None]]


class _LoopStdin:
    """Standard input as text lines, read without a thread (``async for line in stdin``)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._reader: asyncio.StreamReader | None = None
        self._ended = False
        self.answer: Answer | None = None  # how a refused line is answered (``serve`` sets it)

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
                    if end.partial and (text := await self._checked(end.partial)) is not None:
                        yield text
                    return
                except asyncio.LimitOverrunError as overrun:
                    await _skip_line(reader, overrun.consumed)
                    await self._refuse(
                        _error(None, types.PARSE_ERROR, f"a line is at most {MAX_LINE_BYTES} bytes")
                    )
                    continue
                if (text := await self._checked(line)) is not None:
                    yield text
        finally:
            transport.close()

    async def _checked(self, line: bytes) -> str | None:
        """The line as text for the SDK, or None: blank, or answered here (``_refusal``)."""
        text = line.decode("utf-8", errors="replace")
        if not text.strip():
            return None
        refusal = _refusal(text) if self.answer is not None else None
        if refusal is None:
            return text
        await self._refuse(refusal)
        return None

    async def _refuse(self, error: types.JSONRPCError) -> None:
        if self.answer is not None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                await self.answer(error)


def _refusal(text: str) -> types.JSONRPCError | None:
    """None for a JSON-RPC message the SDK takes; else the error that answers the line."""
    try:
        message = types.jsonrpc_message_adapter.validate_json(text, by_name=False)
    except ValueError:  # pydantic's ValidationError
        message = None
    try:
        # A notification has no id: one that does (a request whose id is not a string or
        # an integer) is an invalid request, not a notification to answer nothing.
        if message is not None and not isinstance(message, types.JSONRPCNotification):
            return None
        document = json.loads(text)
        if message is not None and not (isinstance(document, dict) and "id" in document):
            return None
    except (ValueError, RecursionError):
        return _error(None, types.PARSE_ERROR, "Parse error: the line is not JSON")
    ident = document.get("id") if isinstance(document, dict) else None
    if isinstance(ident, bool) or not isinstance(ident, str | int):
        ident = None
    return _error(ident, types.INVALID_REQUEST, "Invalid request: not a JSON-RPC message of MCP")


def _error(ident: str | int | None, code: int, message: str) -> types.JSONRPCError:
    return types.JSONRPCError(jsonrpc="2.0", id=ident, error=types.ErrorData(code=code, message=message))


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
            if self._stdin is not None:
                self._stdin.answer = lambda error: write_stream.send(SessionMessage(error))
            await server.run(read_stream, write_stream, self._service.initialization_options(server))

    def stop(self) -> None:
        if self._stdin is not None:
            self._stdin.end()
