"""Small readings of what the kernel reports, shared by the backends."""

from __future__ import annotations

import math
import select
import signal
from collections.abc import Sequence
from pathlib import Path

_HIGHEST_SIGNAL = signal.SIGRTMAX


def ready(fds: Sequence[int], timeout_s: float, *, writable: bool = False) -> list[int]:
    """The descriptors of ``fds`` ready to read (or to write), their end or an error
    included, within ``timeout_s``: ``select``'s answer through ``poll``, which takes the
    descriptors a busy runner numbers past 1024."""
    watched = select.poll()
    for fd in fds:
        watched.register(fd, select.POLLOUT if writable else select.POLLIN)
    return [fd for fd, _ in watched.poll(math.ceil(max(timeout_s, 0.0) * 1000))]


def read_keyed(path: Path, key: str) -> int:
    """The value of ``key`` in a ``key value`` per line file (cgroup ``*.events``, ``*.stat``);
    0 when the file or the key is missing."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def signal_from_init_status(status: int) -> int | None:
    """The signal N when an init process (bubblewrap's, Docker's) reports 128 + N for a
    child killed by it; None for an ordinary exit status. A tool that itself exits with
    129..192 cannot be told apart."""
    if 128 < status <= 128 + _HIGHEST_SIGNAL:
        return status - 128
    return None
