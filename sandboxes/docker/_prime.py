"""A started container's attach socket as an ``Opening`` speaks through it (blocking, from
the pool's thread): every send and receive under the prime's deadline, the frames
demultiplexed, stderr's to the tail the run reports later. The decoder is the run's own,
so that a frame split across the opening's last read and the run's first is whole."""

from __future__ import annotations

import socket

from sandboxes._priming import PrimingPipe, left_until
from sandboxes.docker._frames import STDOUT, FrameDecoder
from sandboxes.view import READ_CHUNK


class SocketPipe(PrimingPipe):
    """The attach socket ``raw`` (blocking, left so), read through ``decoder``."""

    def __init__(self, raw: socket.socket, decoder: FrameDecoder, max_output: int, timeout_s: float) -> None:
        super().__init__(max_output, timeout_s)
        self._raw = raw
        self._decoder = decoder

    def _write(self, data: bytes, deadline: float) -> None:
        self._raw.settimeout(left_until(deadline))
        try:
            self._raw.sendall(data)  # a timeout is TimeoutError; a closed stdin, ConnectionError
        finally:
            self._raw.settimeout(None)

    def _read(self, deadline: float) -> bytes:
        while True:
            self._raw.settimeout(left_until(deadline))
            try:
                chunk = self._raw.recv(READ_CHUNK)
            finally:
                self._raw.settimeout(None)
            if not chunk:
                return b""
            stdout = []
            for stream, part in self._decoder.feed(chunk):
                if stream == STDOUT:
                    stdout.append(part)
                else:
                    self.stderr.feed(part)
            if stdout:
                return b"".join(stdout)
