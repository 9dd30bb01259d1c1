"""The pipes of a process started ahead, as an ``Opening`` speaks through them (blocking,
from the pool's thread): non-blocking descriptors behind ``poll`` (``_kernel.ready``), so
that no wait outlasts the prime's deadline and stderr is drained while stdout is awaited
(a tool that fills its stderr pipe must not stall its own answer)."""

from __future__ import annotations

import os
import subprocess

from sandboxes._kernel import ready
from sandboxes._priming import PrimingPipe, left_until
from sandboxes.view import READ_CHUNK


class FdPipe(PrimingPipe):
    """``popen``'s stdin, stdout and stderr; they stay non-blocking (as the call's event
    loop wants them when it attaches them)."""

    def __init__(self, popen: subprocess.Popen[bytes], max_output: int, timeout_s: float) -> None:
        super().__init__(max_output, timeout_s)
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        self._in, self._out, self._err = popen.stdin.fileno(), popen.stdout.fileno(), popen.stderr.fileno()
        for fd in (self._in, self._out, self._err):
            os.set_blocking(fd, False)
        self._err_open = True

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            if not ready([self._in], left_until(deadline), writable=True):
                continue
            try:
                view = view[os.write(self._in, view) :]
            except BlockingIOError:
                continue
            # BrokenPipeError is a ConnectionError: the tool closed its stdin.

    def _read(self, deadline: float) -> bytes:
        while True:
            watched = [self._out, self._err] if self._err_open else [self._out]
            readable = ready(watched, left_until(deadline))
            if self._err in readable:
                try:
                    chunk = os.read(self._err, READ_CHUNK)
                except BlockingIOError:
                    chunk = None
                if chunk == b"":
                    self._err_open = False
                elif chunk:
                    self.stderr.feed(chunk)
            if self._out in readable:
                try:
                    return os.read(self._out, READ_CHUNK)
                except BlockingIOError:
                    continue
