"""A loopback HTTP/1.1 proxy that adds ``Authorization: Bearer TOKEN`` to every request:
for a client that cannot send one (the MCP conformance suite) in front of ``runner serve
--http``. Requests are read one by one (a body by its Content-Length); responses, SSE
streams included, are copied back as they come."""

from __future__ import annotations

import asyncio
import contextlib

MAX_HEAD = 64 * 1024


class BearerProxy:
    def __init__(self, upstream_port: int, token: str) -> None:
        self._upstream = upstream_port
        self._header = f"Authorization: Bearer {token}\r\n".encode()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        up_in, up_out = await asyncio.open_connection("127.0.0.1", self._upstream)
        back = asyncio.ensure_future(_copy(up_in, client_out))
        try:
            while True:
                head = await client_in.readuntil(b"\r\n\r\n")
                if len(head) > MAX_HEAD:
                    break
                line, _, rest = head.partition(b"\r\n")
                length = 0
                for header in rest.split(b"\r\n"):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                up_out.write(line + b"\r\n" + self._header + rest)
                if length:
                    up_out.write(await client_in.readexactly(length))
                await up_out.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            up_out.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(back, 5)
            back.cancel()
            client_out.close()


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()
    sink.close()
