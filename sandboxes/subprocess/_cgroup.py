"""One cgroup per attempt, on cgroup v1 or v2.

The cgroup is what makes the limits hold for the tool *as a whole*: memory and pids are
counted over every process the tool starts, and teardown kills every member, including
daemons that left the process group. On v1 (what our CI machines have) each controller
is its own hierarchy; on v2 there is one tree and the runner must own a delegated
subtree (the "no internal processes" rule means the runner cannot hand out children of
a cgroup it sits in itself).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from sandboxes._kernel import read_keyed
from sandboxes._netns_sockets import SandboxSockets
from sandboxes._owners import owner_alive
from sandboxes._socket_memory import TCP_LIMIT_FILE, sockets_overran, tcp_budget

CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 controllers we need: memory and pids are limits; cpuacct tells CPU-limit kills apart.
V1_CONTROLLERS = ("memory", "pids", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CALLS_DIR = "runner-calls"
# Teardown retries: a killed process leaves its cgroup a moment after SIGKILL.
KILL_ROUNDS = 200
KILL_PAUSE_S = 0.005


V1_NEEDS_ROOT = "this machine has cgroup v1, whose hierarchies only root can divide"


class CgroupUnavailable(Exception):
    """No usable cgroup hierarchy; the message says what is missing."""


def _own_path(controller: str | None) -> str:
    """Our own cgroup path in the hierarchy of ``controller`` (None: the v2 tree)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller is None and names == "":
            return path
        if controller is not None and controller in names.split(","):
            return path
    raise CgroupUnavailable(f"this process is in no {controller or 'v2'} cgroup")


def detect_version() -> int:
    """2 for a pure v2 host, 1 when the v1 controllers are mounted."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return 2
    if all((CGROUP_ROOT / c / "cgroup.procs").exists() for c in V1_CONTROLLERS):
        return 1
    raise CgroupUnavailable("no cgroup hierarchy with the memory, pids and cpuacct controllers is mounted")


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


class CallCgroup:
    """The cgroup(s) of one attempt. ``join_files`` are what the launcher joins."""

    def __init__(self, version: int, dirs: list[Path], socket_budget: int = 0) -> None:
        self.version = version
        self.dirs = dirs
        # Sockets its cgroup does not count (not yet accepted): read in its network namespace.
        self._sockets = SandboxSockets(socket_budget) if socket_budget else None

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    @property
    def join_files(self) -> list[Path]:
        """Where the launcher writes ``0`` (itself) to join.

        On v1, ``tasks``: moving the writing thread itself is the one migration the
        kernel does without taking the global threadgroup lock, whose write side waits
        for an RCU grace period (measured: ~10 ms a call here). The launcher is a
        single-threaded shell, so its one thread is the whole process, and everything it
        starts afterwards is born inside. v2 has no such file for a domain cgroup.
        """
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return [d / name for d in self.dirs]

    def cpu_seconds(self) -> float:
        """CPU time used by every process of the attempt so far."""
        if self.version == 1:
            return _read_int(self.dirs[2] / "cpuacct.usage") / 1e9
        return read_keyed(self.dirs[0] / "cpu.stat", "usage_usec") / 1e6

    def oom_kills(self) -> int:
        """Processes of the attempt the kernel killed for the memory limit."""
        if self.version == 1:
            return read_keyed(self.dirs[0] / "memory.oom_control", "oom_kill")
        return read_keyed(self.dirs[0] / "memory.events", "oom_kill")

    def pids_refused(self) -> int:
        """Forks the kernel refused for the pids limit."""
        pids = self.dirs[1] if self.version == 1 else self.dirs[0]
        return read_keyed(pids / "pids.events", "max")

    def sockets_overran(self) -> bool:
        """Whether socket buffers were ever charged past the limit (``sandboxes._socket_memory``),
        or the sockets of the tool's network namespace hold more than that now
        (``sandboxes._netns_sockets``)."""
        if sockets_overran(self.version, self.dirs[0]):
            return True
        return self._sockets is not None and self._sockets.over_budget(lambda: self.members(everywhere=False))

    def members(self, everywhere: bool = True) -> set[int]:
        """The processes in the attempt's cgroups. ``everywhere=False`` reads only the one
        the launcher joins first (what runs on the event loop: one file, not three).

        That one holds them all: on v1 the launcher joins every hierarchy before it
        starts anything, so its descendants are born in all of them, and the tool has no
        cgroup filesystem to move a process with. Only a launcher killed halfway through
        its joins is in the first and not the others. The teardown still reads them all.
        """
        pids: set[int] = set()
        for procs in self.procs_files if everywhere else self.procs_files[:1]:
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
        return pids

    def _kernel_kill(self) -> bool:
        """v2's ``cgroup.kill``: the kernel kills every member. False where there is none."""
        if self.version != 2:
            return False
        kill_file = self.dirs[0] / "cgroup.kill"
        if not kill_file.exists():
            return False
        with contextlib.suppress(OSError):
            _write(kill_file, "1")
        return True

    def kill_once(self) -> None:
        """One round of kills, never sleeping: what may run on an event loop. ``kill_all``
        (in a thread) makes sure later."""
        if not self._kernel_kill():
            kill_members_once(self, everywhere=False)

    def kill_all(self) -> None:
        """SIGKILL every member until none is left (or give up after a bounded wait).

        Never by a bare pid read from ``cgroup.procs``: that process may have exited and
        its pid gone to an unrelated one (``pid_max`` is small) between the read and the
        kill. v2's ``cgroup.kill`` kills inside the kernel; elsewhere each member is
        pinned with a pidfd and signalled only if it is still listed after the pin.
        """
        self._kernel_kill()
        for _ in range(KILL_ROUNDS):
            if not kill_members_once(self):
                return
            time.sleep(KILL_PAUSE_S)

    def remove(self) -> None:
        """Kill what is left and remove the directories. Safe to call twice."""
        if self._sockets is not None:
            self._sockets.close()
        self.kill_all()
        for d in self.dirs:
            for _ in range(KILL_ROUNDS):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    time.sleep(KILL_PAUSE_S)


def kill_members_once(group: CallCgroup, everywhere: bool = True) -> bool:
    """One round of pidfd-pinned kills; False when the cgroup had no member left
    (``everywhere``: as ``CallCgroup.members``)."""
    listed = group.members(everywhere)
    if not listed:
        return False
    pinned: dict[int, int] = {}
    try:
        for pid in listed:
            with contextlib.suppress(OSError):  # gone already, or not ours to see
                pinned[pid] = os.pidfd_open(pid)
        # A pid still listed after its pidfd was opened is the process that fd pins.
        still = group.members(everywhere)
        for pid, fd in pinned.items():
            if pid in still:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        for fd in pinned.values():
            os.close(fd)
    return True


def remove_groups(version: int, parents: Iterable[Path], wanted: Callable[[str], bool]) -> int:
    """Kill and remove every call cgroup under ``parents`` whose name is ``wanted`` (one
    call's folders in each v1 hierarchy together). Returns how many calls."""
    groups: dict[str, list[Path]] = {}
    for parent in parents:
        with contextlib.suppress(OSError):
            for child in parent.iterdir():
                if wanted(child.name) and child.is_dir():
                    groups.setdefault(child.name, []).append(child)
    for dirs in groups.values():
        CallCgroup(version, dirs).remove()
    return len(groups)


class CgroupFactory:
    """Creates per-attempt cgroups under ``<our cgroup>/runner-calls``.

    Each call cgroup is named ``<runner pid>-<sequence>`` so a runner that starts can tell
    which leftovers belong to a runner that is gone.
    """

    def __init__(self) -> None:
        self.version = detect_version()
        if self.version == 1 and os.geteuid() != 0:
            raise CgroupUnavailable(V1_NEEDS_ROOT)
        self._parents = self._make_parents()
        self._sequence = 0
        if os.geteuid() != 0:
            # A user's subtree may take a folder and still refuse its limits: found out
            # here, once, rather than by every call.
            self.create(1, 1).remove()

    @property
    def parents(self) -> list[Path]:
        return list(self._parents)

    def _make_parents(self) -> list[Path]:
        if self.version == 1:
            parents = [CGROUP_ROOT / c / _own_path(c).lstrip("/") / CALLS_DIR for c in V1_CONTROLLERS]
        else:
            parents = [self._v2_parent()]
        for parent in parents:
            try:
                parent.mkdir(exist_ok=True)
            except OSError as exc:
                raise CgroupUnavailable(f"cannot create cgroup {parent}: {exc.strerror}") from exc
        return parents

    def _v2_parent(self) -> Path:
        override = os.environ.get("RUNNER_CGROUP_ROOT")
        base = Path(override) if override else CGROUP_ROOT / _own_path(None).lstrip("/")
        parent = base / CALLS_DIR
        parent.mkdir(exist_ok=True)
        wanted = " ".join(f"+{c}" for c in V2_CONTROLLERS)
        try:
            _write(parent / "cgroup.subtree_control", wanted)
        except OSError as exc:
            # Enabling controllers for our children needs them enabled in ``base`` too,
            # which the kernel refuses while ``base`` holds processes (ours).
            try:
                _write(base / "cgroup.subtree_control", wanted)
                _write(parent / "cgroup.subtree_control", wanted)
            except OSError:
                raise CgroupUnavailable(
                    f"cgroup v2 controllers {wanted} cannot be delegated under {base}; "
                    "run the runner in a delegated cgroup "
                    "(systemd-run --user --scope -p Delegate=yes runner ...) "
                    "or set RUNNER_CGROUP_ROOT"
                ) from exc
        return parent

    def create(self, memory_mb: int, max_pids: int) -> CallCgroup:
        """A fresh cgroup with the memory (swap included) and pids limits set.

        Raises:
            CgroupUnavailable: the cgroup could not be created or limited.
        """
        self._sequence += 1
        name = f"{os.getpid()}-{self._sequence}-{time.monotonic_ns()}"
        dirs = [parent / name for parent in self._parents]
        group = CallCgroup(self.version, dirs, tcp_budget(memory_mb))
        limit = str(memory_mb * 1024 * 1024)
        try:
            for d in dirs:
                d.mkdir()
            if self.version == 1:
                memory, pids, _ = dirs
                _write(memory / "memory.limit_in_bytes", limit)
                swap = memory / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    _write(swap, limit)
                # v1 keeps socket buffers outside memory.limit_in_bytes (v2 charges them to
                # memory.max). Writing the limit is also what turns the accounting on; a
                # tool that passes it anyway is stopped (``CallCgroup.sockets_overran``).
                _write(memory / TCP_LIMIT_FILE, str(tcp_budget(memory_mb)))
                _write(pids / "pids.max", str(max_pids))
            else:
                (unified,) = dirs
                _write(unified / "memory.max", limit)
                with contextlib.suppress(FileNotFoundError):
                    _write(unified / "memory.swap.max", "0")
                _write(unified / "pids.max", str(max_pids))
        except OSError as exc:
            group.remove()
            raise CgroupUnavailable(f"cannot set up cgroup: {exc.strerror}") from exc
        return group

    def remove_stale(self) -> int:
        """Remove call cgroups left by runners that are no longer alive. Returns how many."""
        return remove_groups(self.version, self._parents, lambda name: not owner_alive(name))
