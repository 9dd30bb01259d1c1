"""The limits of a rootless sandbox's tool as a whole, without a cgroup to count them.

Rlimits bound each process by itself: four children under the memory limit each may hold
four times it together, and each may use the CPU budget anew. So while the tool runs the
runner adds up the resident memory and the CPU time of every process under the sandbox's
launcher (the pid namespace keeps them all there: an orphan goes to bubblewrap's init,
itself under the launcher) and ends the run when a sum passes its limit. This is polled,
as the cgroup counters are: a burst between two looks is caught at the next one, and the
address-space rlimit caps each process in the meantime.
"""

from __future__ import annotations

import contextlib

import psutil

from sandboxes.base import Limits
from sandboxes.subprocess._process import Ending


class ProcessTree:
    """The processes under one launcher, summed."""

    def __init__(self, root_pid: int, limits: Limits) -> None:
        self._root_pid = root_pid
        self._memory_bytes = limits.memory_mb * 1024 * 1024
        self._cpu_seconds = limits.cpu_seconds
        self._root: psutil.Process | None = None

    def _members(self) -> list[psutil.Process]:
        if self._root is None:
            self._root = psutil.Process(self._root_pid)
        return [self._root, *self._root.children(recursive=True)]

    def breached(self) -> Ending | None:
        """The limit the tool's processes together have passed, if any."""
        try:
            members = self._members()
        except psutil.Error:
            return None  # the launcher is gone: the run is ending anyway
        rss = 0
        cpu = 0.0
        for member in members:
            # suppress: one that exited between the two reads
            with contextlib.suppress(psutil.Error), member.oneshot():
                rss += member.memory_info().rss
                times = member.cpu_times()
                # children_*: the descendants already reaped, counted by their parent
                cpu += times.user + times.system + times.children_user + times.children_system
        if rss > self._memory_bytes:
            return Ending.MEMORY_LIMIT
        if cpu > self._cpu_seconds:
            return Ending.CPU_BUDGET
        return None
