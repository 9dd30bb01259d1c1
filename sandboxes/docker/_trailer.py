"""The gate's last words: the tool's exit status, said before the daemon would say it.

After the tool exits the daemon ends the attach stream only once containerd has deleted
the task (~20-45 ms here), and tells the exit status later still (``wait``/``inspect``).
So the gate (``sandbox.GATE``) runs the tool in a subshell that execs it, then writes a
trailer, ``<marker> <token> <status>\\n``, on stdout and on stderr: each stream is
ordered, so once both trailers are read everything the tool wrote has arrived. The
token is fresh per container, read by the gate from its stdin and never exported: the
tool never has it (it could only read it from the gate's memory, and then say no more
than it could say by exiting with that status). The call still returns only once the
container's cgroup is empty (``_prepared.PreparedContainer``), and the limits are read
from that cgroup as before; a trailer that does not come (the gate killed, a stream cut)
leaves the run to the daemon's end of stream and exit status, as before.
"""

from __future__ import annotations

import re
from typing import Protocol

MARKER = b"runner-gate-exit"
_STATUS = re.compile(rb"[0-9]{1,3}")
_MAX_STATUS_DIGITS = 3


class Sink(Protocol):
    def feed(self, data: bytes) -> None: ...


class TrailerReader:
    """One stream of the container on its way to ``sink``, less the gate's trailer.

    The last bytes are held back until they cannot start the trailer; ``status`` is set
    once it has come whole (what follows it, from a leftover process, is dropped).
    ``flush`` hands on what is held when the stream ends without one.
    """

    def __init__(self, sink: Sink, token: str) -> None:
        self._sink = sink
        self._prefix = MARKER + b" " + token.encode() + b" "
        self._held = b""
        self.status: int | None = None

    def feed(self, data: bytes) -> None:
        """Raises what ``sink.feed`` raises (``OutputOverflow`` for stdout)."""
        if self.status is not None:
            return
        buffer = self._held + data
        start = buffer.find(self._prefix)
        if start < 0:
            # Keep only what could be the start of a trailer split across reads: a line
            # ended by a newline (a hosted server's message) goes on at once.
            keep = next(
                (
                    k
                    for k in range(min(len(buffer), len(self._prefix) - 1), 0, -1)
                    if buffer.endswith(self._prefix[:k])
                ),
                0,
            )
            self._held = buffer[len(buffer) - keep :]
            self._pass(buffer[: len(buffer) - keep])
            return
        self._pass(buffer[:start])
        rest = buffer[start + len(self._prefix) :]
        end = rest.find(b"\n")
        if end < 0 and len(rest) <= _MAX_STATUS_DIGITS:
            self._held = buffer[start:]  # the status is on its way
            return
        self._held = b""
        if end >= 0 and _STATUS.fullmatch(rest[:end]):
            self.status = int(rest[:end])
        else:  # not the gate's (it writes one to three digits): the tool's own bytes
            self._pass(buffer[start:])

    def flush(self) -> None:
        """The stream ended without a trailer: hand on what was held back."""
        held, self._held = self._held, b""
        self._pass(held)

    def _pass(self, data: bytes) -> None:
        if data:
            self._sink.feed(data)


def both_said(readers: tuple[TrailerReader, TrailerReader]) -> int | None:
    """The exit status once both streams' trailers agree on it; else None."""
    out, err = readers
    if out.status is not None and out.status == err.status:
        return out.status
    return None
