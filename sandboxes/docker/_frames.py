"""Docker's multiplexed attach stream: 8-byte headers (stream, 0, 0, 0, size32be)."""

from __future__ import annotations

import struct

HEADER = struct.Struct(">BxxxL")
STDOUT, STDERR = 1, 2


class FrameDecoder:
    """Feed raw bytes, get ``(stream, payload)`` frames; partial frames wait for more."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            stream, size = HEADER.unpack_from(self._buffer)
            end = HEADER.size + size
            if len(self._buffer) < end:
                break
            frames.append((stream, bytes(self._buffer[HEADER.size : end])))
            del self._buffer[:end]
        return frames
