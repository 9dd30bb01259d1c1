"""``runner audit --follow``: the events already in the log, then each one as it is appended.

Like ``tail -F``: a line is taken only once it is complete (the writer may be half way
through it), a log truncated or replaced by rotation is read again from its start, and the
follower stops by itself when the reader of its output has gone (``| head``), checked
between polls, so it does not linger until the next event arrives.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from runner.audit.query import AuditFilter, read_events

POLL_S = 0.2  # how often the log is looked at again: prompt enough for a person watching
READ_BYTES = 1 << 20  # per read: a large backlog is streamed, never held whole
ReaderGone = Callable[[], bool]


def follow(
    path: Path,
    wanted: AuditFilter,
    reader_gone: ReaderGone,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[dict[str, Any]]:
    """Matching events of ``path``, forever (until ``reader_gone()`` says stop).

    Raises:
        OSError: the log cannot be opened or read.
    """
    log = path.open("rb")
    try:
        identity = os.fstat(log.fileno())
        pending = b""
        while not reader_gone():
            chunk = log.read(READ_BYTES)
            if chunk:
                complete, _, pending = (pending + chunk).rpartition(b"\n")
                lines = (line.decode("utf-8", errors="replace") for line in complete.split(b"\n"))
                yield from (event for event in read_events(lines) if wanted.matches(event))
                continue
            if _replaced(path, identity, log.tell()):
                log.close()
                log = path.open("rb")
                identity, pending = os.fstat(log.fileno()), b""
                continue
            sleep(POLL_S)
    finally:
        log.close()


def _replaced(path: Path, identity: os.stat_result, offset: int) -> bool:
    """Rotated away (another file at ``path`` now) or truncated below what was read."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False  # mid-rotation: keep the old file until the new one appears
    if (now.st_dev, now.st_ino) != (identity.st_dev, identity.st_ino):
        return True
    return now.st_size < offset


def pipe_reader_gone(stream: TextIO) -> ReaderGone:
    """A check that the reading end of ``stream`` has closed (always False on a terminal or
    a file: only a pipe or socket reports it)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return lambda: False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are reported whatever is asked for

    def gone() -> bool:
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))

    return gone
