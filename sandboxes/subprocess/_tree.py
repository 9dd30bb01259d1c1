"""The limits of a rootless sandbox's tool as a whole, without a cgroup to count them.

Rlimits bound each process by itself: four children under the memory limit each may hold
four times it together, and each may use the CPU budget anew. So while the tool runs the
runner adds up the resident memory and the CPU time of every process under the sandbox's
launcher (the pid namespace keeps them all there: an orphan goes to bubblewrap's init,
itself under the launcher) and ends the run when a sum passes its limit. This is polled,
as the cgroup counters are: a burst between two looks is caught at the next one, and the
address-space rlimit, twice the memory limit, caps each process in the meantime (twice:
a process's address space runs well ahead of what it uses, and a child stopped by it
alone would leave no trace a parent waiting on it could be stopped for).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from sandboxes._streams import TailBuffer
from sandboxes._watchdog import forget_sandbox_init, parent_and_start, watch_sandbox_init
from sandboxes.base import Limits
from sandboxes.events import StderrSplitter
from sandboxes.subprocess._outcome import out_of_memory
from sandboxes.subprocess._process import Ending

KILL_PAUSE_S = 0.005


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ProcessTree:
    """The processes under one launcher, summed."""

    def __init__(self, root_pid: int, limits: Limits) -> None:
        self._root_pid = root_pid
        self._memory_bytes = limits.memory_mb * 1024 * 1024
        self._cpu_seconds = limits.cpu_seconds
        self._root: psutil.Process | None = None
        self._seen: dict[int, psutil.Process] = {}
        self._init: tuple[int, int] | None = None  # bubblewrap's pid 1 (pid, start time), once seen

    def _members(self) -> list[psutil.Process]:
        if self._root is None:
            self._root = psutil.Process(self._root_pid)
        members = [self._root, *self._root.children(recursive=True)]
        self._seen.update((member.pid, member) for member in members)
        if self._init is None:
            self._note_init(members)
        if len(self._seen) > 2 * len(members) + 256:  # a long session's dead pids, dropped
            self._seen = {pid: seen for pid, seen in self._seen.items() if seen.is_running()}
        return members

    def _note_init(self, members: list[psutil.Process]) -> None:
        """Have the watchdog kill the sandbox's init should the runner die: a tool can
        unmark it and clear its parent-death signal (``watch_sandbox_init``). The init is
        bubblewrap's child: looked for once the launcher (which execs, never forks, on its
        way there) is bubblewrap, not while its mounts run as its children; from the
        first look that shows it, the first poll of the limits at the latest."""
        try:
            if Path(f"/proc/{self._root_pid}/comm").read_text().strip() != "bwrap":
                return
        except OSError:
            return
        for member in members[1:]:
            with contextlib.suppress(OSError):
                parent, started = parent_and_start(member.pid)
                if parent == self._root_pid:
                    watch_sandbox_init(member.pid, started)
                    self._init = (member.pid, started)
                    return

    def _forget(self) -> None:
        # Every process of the sandbox is gone: the watchdog may let its init go.
        if self._init is not None:
            forget_sandbox_init(*self._init)
            self._init = None

    def look(self) -> None:
        """Note the processes there are now (``kill_all`` kills them should the launcher
        be gone by then, and its children with it out of reach)."""
        with contextlib.suppress(psutil.Error):
            self._members()

    def kill_all(self, grace_s: float) -> None:
        """SIGKILL every process of the tree, as it is now and as last seen, and wait (at
        most ``grace_s``) until none runs. A process already dead (or its pid reused:
        psutil checks its start time) is left alone; a zombie counts as gone (its parent,
        or the host's init, reaps it), and the launcher is left to its ``Popen`` to reap.
        Blocking: from a thread."""
        self.look()
        members = list(self._seen.values())
        for member in members:
            with contextlib.suppress(psutil.Error):
                member.kill()
        others = [member for member in members if member.pid != self._root_pid]
        deadline = time.monotonic() + grace_s
        while any(_running(member) for member in others) and time.monotonic() < deadline:
            time.sleep(KILL_PAUSE_S)
        if not any(_running(member) for member in others):
            self._forget()  # else the watchdog keeps it, for the runner's end

    def _sums(self) -> tuple[int, float] | None:
        """Resident bytes and CPU seconds of all the processes; None once the launcher is gone."""
        try:
            members = self._members()
        except psutil.Error:
            return None
        rss = 0
        cpu = 0.0
        for member in members:
            # suppress: one that exited between the two reads
            with contextlib.suppress(psutil.Error), member.oneshot():
                rss += member.memory_info().rss
                times = member.cpu_times()
                # children_*: the descendants already reaped, counted by their parent
                cpu += times.user + times.system + times.children_user + times.children_system
        return rss, cpu

    def cpu_seconds(self) -> float | None:
        """CPU time of the processes alive now, and of their descendants reaped already."""
        sums = self._sums()
        return None if sums is None else sums[1]

    def breached(self) -> Ending | None:
        """The limit the tool's processes together have passed, if any."""
        sums = self._sums()
        if sums is None:
            return None  # the launcher is gone: the run is ending anyway
        rss, cpu = sums
        if rss > self._memory_bytes:
            return Ending.MEMORY_LIMIT
        if cpu > self._cpu_seconds:
            return Ending.CPU_BUDGET
        return None

    def watch(self, stderr: TailBuffer | StderrSplitter) -> Callable[[], Ending | None]:
        """What the run polls: the sums, and the stderr of the tool, where a child the
        address-space rlimit stopped says so while its parent may wait on (a cgroup's
        OOM counter would show it)."""

        def breached() -> Ending | None:
            return Ending.MEMORY_LIMIT if out_of_memory(stderr.text()) else self.breached()

        return breached
