"""A started container's attach socket, as its run reads and writes it: the tool's stdin
written through the socket, stdout and stderr read as multiplexed frames (as
``sandboxes/subprocess/_attach.py`` is for a process's pipes).

SDK pitfalls handled here: the attach socket is written through its underlying socket;
end of input is a half-close (``stdin_once`` makes Docker pass it on); stdout and stderr
arrive multiplexed in 8-byte-header frames (no TTY); reads run under our own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from sandboxes._exchange import StdoutSink
from sandboxes._exec_status import new_token, token_line
from sandboxes._streams import OutputOverflow
from sandboxes.docker._cgroup import ContainerCgroup
from sandboxes.docker._frames import STDOUT, FrameDecoder
from sandboxes.docker._trailer import Sink, TrailerReader, both_said
from sandboxes.view import READ_CHUNK

# After a dialogue's end and the kill, the stream ends as soon as the daemon has copied
# what the pipes held; this only bounds the wait should it not.
STDERR_DRAIN_S = 0.5


class StdoutValve:
    """A run's stdout on its way to ``sink`` until shut: at a dialogue's end (what comes
    after is in no answer and counts against no cap), or as it passes the cap (then
    ``overflowed`` is done). Either way the stream is read on, for the rest of stderr."""

    def __init__(self, sink: StdoutSink) -> None:
        self._sink: StdoutSink | None = sink
        self.overflowed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def shut(self) -> None:
        self._sink = None

    def feed(self, data: bytes) -> None:
        if self._sink is None:
            return
        try:
            self._sink.feed(data)
        except OutputOverflow:
            self._sink = None
            self.overflowed.set_result(None)

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()


class SocketStdin:
    """The container's stdin, written through the attach socket."""

    def __init__(self, raw: socket.socket) -> None:
        self._raw = raw

    async def write(self, data: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self._raw, data)
        except ConnectionError:
            raise
        except OSError as exc:  # the socket is closed: the container is gone
            raise ConnectionResetError(f"the container's stdin is closed: {exc.strerror}") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._raw.shutdown(socket.SHUT_WR)  # end of input, passed on thanks to stdin_once


async def read_frames(
    raw: socket.socket,
    decoder: FrameDecoder,
    stdout: StdoutSink,
    stderr: Sink,
    gate_token: str = "",
    stop_at_trailer: bool = True,
) -> int | None:
    """Read the attach stream through ``decoder``, each frame to its sink, to its end or,
    given the gate's token, until the gate's trailers (``_trailer``) have come on both
    streams: then the exit status they said (the rest of the stream is left unread).
    Without ``stop_at_trailer`` the trailers are only taken out, and the stream read to
    its end (under another runtime: gVisor's gate ends with an error status when its
    stream is closed under it while it still writes).

    Raises:
        OutputOverflow: ``stdout`` passed its cap (reading stops there; a ``StdoutValve``
            takes the overflow and the reading goes on).
        OSError: the connection to the daemon was lost.
    """
    loop = asyncio.get_running_loop()
    readers = (TrailerReader(stdout, gate_token), TrailerReader(stderr, gate_token)) if gate_token else None
    out, err = readers if readers is not None else (stdout, stderr)
    while chunk := await loop.sock_recv(raw, READ_CHUNK):
        for stream, part in decoder.feed(chunk):
            (out if stream == STDOUT else err).feed(part)
        if stop_at_trailer and readers is not None and (status := both_said(readers)) is not None:
            stdout.close()
            return status
    if readers is not None:
        for reader in readers:
            reader.flush()
    stdout.close()
    return None


async def drain(attached: Attached) -> None:
    """Let the dialogue's reader (``Attached.reader``) read a killed container's stream to
    its end, for the rest of its stderr; at most ``STDERR_DRAIN_S``. A lost connection
    only ends the wait sooner."""
    reader = attached.reader
    if reader is not None:
        await asyncio.wait({reader}, timeout=STDERR_DRAIN_S)
    await stop_reading(attached)


async def stop_reading(attached: Attached) -> None:
    """Cancel the dialogue's reader, if still reading, and wait for its end: the socket
    is closed after, never under a read still pending."""
    reader, attached.reader = attached.reader, None
    if reader is None:
        return
    reader.cancel()
    await asyncio.wait({reader})
    if not reader.cancelled():
        reader.exception()  # retrieved: it ended the reading and nothing more


async def hang_up(attached: Attached) -> None:
    """``stop_reading``, then close the socket, even if cancelled meanwhile."""
    try:
        await stop_reading(attached)
    finally:
        attached.close()


class Attached:
    """A started container's attach socket, with what its run needs besides."""

    def __init__(self, sock: Any, token: str) -> None:
        self.sock = sock
        self.raw: socket.socket = getattr(sock, "_sock", sock)  # SocketIO is read-only as returned
        self.token = token
        self.cgroup: ContainerCgroup | None = None
        self.unsent = b""  # the gate's release, when not written yet
        self.decoder = FrameDecoder()  # the primer's first, then the run's
        self.gate_token = new_token()  # the gate's trailer's (``_trailer``)
        self.said: int | None = None  # the exit status the gate's trailers said
        # A dialogue's reader, still reading past the dialogue's end (``drain``): a read
        # cancelled just as its bytes came would drop them, the rest of stderr among them.
        self.reader: asyncio.Future[int | None] | None = None

    def release(self, secrets: bytes) -> bytes:
        """What the gate reads before it execs the tool (``GATE``)."""
        return token_line(self.gate_token) + secrets + token_line(self.token)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        with contextlib.suppress(OSError):
            self.raw.close()
        with contextlib.suppress(OSError):
            self.sock.close()
