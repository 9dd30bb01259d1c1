"""Priming a warm sandbox (a hosted MCP server's), the same way in every backend: an ``Opening`` speaks
with the tool started ahead, from the pool's thread, through a blocking pipe that the
backend gives (``PrimingPipe``: popen's pipes, docker's attach socket).

Every wait is bounded by the prime's deadline; what the tool writes on stdout counts
against the run's ``max_output_bytes``, and what it writes on stderr goes to the tail its
run reports later. What the opening received but did not consume is handed, with the
rest, to the call's dialogue (``Opened``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from sandboxes._streams import TailBuffer
from sandboxes.base import Opening, OpeningFailed
from sandboxes.view import STDERR_TAIL_BYTES


@dataclass(frozen=True)
class Opened:
    """What an opening left for the call: stdout received but not consumed, how much of
    the run's output cap the opening itself consumed, and the stderr tail so far."""

    unread: bytes
    spent: int
    stderr: TailBuffer


class PrimingPipe(ABC):
    """An ``OpeningPipe`` over a backend's own blocking I/O, with the prime's deadline and
    the run's output cap; the backend reads stderr into ``stderr`` while it waits."""

    def __init__(self, max_output: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.stderr = TailBuffer(STDERR_TAIL_BYTES)
        self.received = 0
        self._max_output = max_output
        self._deadline = time.monotonic() + timeout_s

    def send(self, data: bytes) -> None:
        self._write(data, self._deadline)

    def receive(self, timeout_s: float) -> bytes:
        deadline = min(time.monotonic() + timeout_s, self._deadline)
        data = self._read(deadline)
        self.received += len(data)
        if self.received > self._max_output:
            raise OpeningFailed(f"it wrote more than max_output_bytes ({self._max_output}) on stdout")
        return data

    @abstractmethod
    def _write(self, data: bytes, deadline: float) -> None:
        """All of ``data`` to the tool's stdin by ``deadline`` (``time.monotonic``).

        Raises:
            ConnectionError: the tool's stdin is closed.
            TimeoutError: the deadline passed first.
        """

    @abstractmethod
    def _read(self, deadline: float) -> bytes:
        """The next stdout bytes (stderr read meanwhile into ``stderr``); b"" at its end.

        Raises:
            TimeoutError: nothing on stdout by ``deadline``.
            OSError: the pipe or socket failed.
        """


def left_until(deadline: float) -> float:
    """Seconds left before ``deadline``.

    Raises:
        TimeoutError: none are.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def prime_with(opening: Opening, pipe: PrimingPipe) -> Opened:
    """Let ``opening`` speak through ``pipe``; what it left for the call.

    Raises:
        OpeningFailed: the opening failed, the deadline passed, the tool closed a pipe.
    """
    try:
        unread = opening.open(pipe, pipe.timeout_s)
    except TimeoutError as exc:
        raise OpeningFailed(f"it did not answer within {pipe.timeout_s * 1000:.0f} ms") from exc
    except ConnectionError as exc:
        raise OpeningFailed("it closed its input") from exc
    except OSError as exc:
        raise OpeningFailed(f"its pipes failed: {exc.strerror or type(exc).__name__}") from exc
    unread = unread[-pipe.received :] if pipe.received else b""  # never more than came
    return Opened(unread, pipe.received - len(unread), pipe.stderr)
