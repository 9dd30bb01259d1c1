"""Byte sinks with hard bounds, shared by the backends.

A tool's output is untrusted and may be endless; nothing here grows past its bound.
"""

from __future__ import annotations


class OutputOverflow(Exception):
    """More bytes arrived than the cap allows."""


class TailBuffer:
    """Keeps only the last ``cap`` bytes of a stream (stderr is kept as a tail)."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._data = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        self._data += data
        if len(self._data) > self._cap:
            del self._data[: len(self._data) - self._cap]

    def text(self) -> str:
        data = self._data
        if self.total > len(data):
            # Cut inside a character: its last bytes alone would decode as U+FFFD, which
            # would hide the end of a secret cut there from the scrub of a cut tail.
            start = 0
            while start < min(3, len(data)) and data[start] & 0xC0 == 0x80:
                start += 1
            data = data[start:]
        return data.decode("utf-8", errors="replace")
