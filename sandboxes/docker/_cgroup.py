"""A running container's own cgroup, read on this host (a local daemon only).

Docker's limits hold per container, but it reports only how the main process ended. Its
cgroup tells the rest while the container runs: the CPU time of all its processes, OOM
kills of any of them, forks refused for the pids limit. On cgroup v1 the kernel also
counts TCP socket buffers apart from ``memory.limit_in_bytes``; their own limit
(``memory.kmem.tcp.limit_in_bytes``) is set here, as neither Docker nor runc sets it.
The directory is gone once the container exits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from sandboxes._kernel import read_keyed
from sandboxes._socket_memory import TCP_LIMIT_FILE, sockets_overran

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Where a local daemon puts a container's cgroup: cgroupfs driver, then systemd driver.
V1_LAYOUTS = ("{controller}/docker/{id}", "{controller}/system.slice/docker-{id}.scope")
V2_LAYOUTS = ("docker/{id}", "system.slice/docker-{id}.scope")
V1_CONTROLLERS = ("memory", "cpuacct", "pids")


@dataclass(frozen=True)
class ContainerCgroup:
    """The cgroup directories of one running container."""

    version: int
    memory: Path
    cpu: Path
    pids: Path

    @classmethod
    def find(cls, container_id: str) -> ContainerCgroup | None:
        """The container's cgroup on this host, or None (a remote daemon, another layout,
        or a container that has already exited)."""
        for layout in V1_LAYOUTS:
            dirs = [CGROUP_ROOT / layout.format(controller=c, id=container_id) for c in V1_CONTROLLERS]
            if all(d.is_dir() for d in dirs):
                return cls(1, *dirs)
        for layout in V2_LAYOUTS:
            unified = CGROUP_ROOT / layout.format(id=container_id)
            if (unified / "cgroup.procs").is_file():
                return cls(2, unified, unified, unified)
        return None

    def cpu_seconds(self) -> float:
        """CPU time used by every process of the container so far."""
        if self.version == 1:
            with contextlib.suppress(OSError, ValueError):
                return int((self.cpu / "cpuacct.usage").read_text()) / 1e9
            return 0.0
        return read_keyed(self.cpu / "cpu.stat", "usage_usec") / 1e6

    def oom_kills(self) -> int:
        """Processes of the container the kernel killed for the memory limit."""
        if self.version == 1:
            return read_keyed(self.memory / "memory.oom_control", "oom_kill")
        return read_keyed(self.memory / "memory.events", "oom_kill")

    def pids_refused(self) -> int:
        """Forks the kernel refused for the pids limit."""
        return read_keyed(self.pids / "pids.events", "max")

    def sockets_overran(self) -> bool:
        """Whether socket buffers were ever charged past the limit (``sandboxes._socket_memory``)."""
        return sockets_overran(self.version, self.memory)

    def members(self) -> list[int]:
        """The host pids of the container's processes (none once its cgroup is gone)."""
        try:
            return [int(pid) for pid in (self.pids / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def empty(self) -> bool:
        """Whether no process is left in the container (its cgroup gone counts as empty)."""
        try:
            return not (self.pids / "cgroup.procs").read_text().strip()
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def limit_tcp_memory(self, limit_bytes: int) -> None:
        """Cap the container's TCP socket buffers (v1; v2 charges them to ``memory.max``).

        Only sockets created after this are charged: call it before the tool runs.

        Raises:
            OSError: the limit could not be set, or did not hold when read back.
        """
        if self.version != 1:
            return
        path = self.memory / TCP_LIMIT_FILE
        path.write_text(str(limit_bytes))
        # The kernel rounds down to whole pages.
        if int(path.read_text()) > limit_bytes:
            raise OSError(f"{TCP_LIMIT_FILE} did not take the limit")
