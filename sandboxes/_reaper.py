"""The watchdog process (see ``sandboxes._watchdog``, the runner's side): it reads what
to sweep from the runner's pipe until end-of-file, then kills and removes what the dead
runner left: its call cgroups, the sandbox inits it was told (held by pidfds), the
processes carrying its mark, its containers, scratch folders and staged workspaces.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sandboxes._watchdog import OWNER_MARK, parent_and_start

# How long a dead runner's last threads may take to leave the kernel (a v1 cgroup
# operation waits out an RCU grace period) before the second sweep goes ahead anyway.
FULL_EXIT_WAIT_S = 10.0
# A container create the runner sent just before dying may land after the first sweep.
DOCKER_SWEEPS_S = (0.0, 0.5, 2.0)
# How long the last sweep of the scratch folders tries while one is left (its sandbox
# was killed, its namespaces are going).
SCRATCH_GONE_S = 3.0


def _sweep_cgroups(owner: int, parents: Iterable[tuple[int, Path]]) -> None:
    from sandboxes.subprocess._cgroup import remove_groups

    by_version: dict[int, list[Path]] = {}
    for version, parent in parents:
        by_version.setdefault(version, []).append(parent)
    for version, same in by_version.items():
        remove_groups(version, same, lambda name: name.startswith(f"{owner}-"))


def _sweep_scratch(owner: int, roots: Iterable[Path]) -> None:
    from sandboxes._owners import remove_folders

    for root in roots:
        remove_folders(root, lambda name: name.startswith(f"{owner}-"))


def _sweep_scratch_until_gone(owner: int, roots: list[Path], within_s: float) -> None:
    from sandboxes._owners import own_folder_names

    deadline = time.monotonic() + within_s
    while True:
        _sweep_scratch(owner, roots)
        left = any(name.startswith(f"{owner}-") for root in roots for name in own_folder_names(root))
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _sweep_docker(owner: int) -> None:
    try:
        from docker import APIClient
        from docker.utils import kwargs_from_env

        from sandboxes.docker._client import owner_filter
    except ImportError:
        return
    try:
        client = APIClient(**kwargs_from_env(), timeout=10)
    except Exception:  # no daemon: nothing of ours can be running there
        return
    label = owner_filter(owner)  # this pid in this pid namespace, not another's
    for pause in DOCKER_SWEEPS_S:
        time.sleep(pause)
        with contextlib.suppress(Exception):
            ids = [c["Id"] for c in client.containers(all=True, filters={"label": label})]
            # Kill all first (what the guarantee is about), then remove at leisure.
            killers = [threading.Thread(target=_quietly, args=(client.kill, cid)) for cid in ids]
            for thread in killers:
                thread.start()
            for thread in killers:
                thread.join()
            for cid in ids:
                _quietly(lambda cid: client.remove_container(cid, v=True, force=True), cid)


def _sweep_marked(owner: int) -> None:
    """Kill this user's processes whose environment holds ``RUNNER_OWNER=<owner>``, each
    pinned by a pidfd before its environment is read."""
    needle = f"{OWNER_MARK}={owner}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fd = os.pidfd_open(int(entry.name))
        except OSError:
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass  # gone, or not ours to read
        finally:
            os.close(fd)


def _sweep_processes(
    owner: int, cgroups: Iterable[tuple[int, Path]], marked: bool, inits: dict[str, int]
) -> None:
    _sweep_cgroups(owner, cgroups)
    for pinned in list(inits.values()):  # each init's death ends its pid namespace
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pinned, signal.SIGKILL)
    if marked:
        _sweep_marked(owner)


def _note_init(inits: dict[str, int], alive: bool, value: str) -> None:
    if not alive:
        with contextlib.suppress(KeyError, OSError):
            os.close(inits.pop(value))
    elif value not in inits and (pinned := _pin(value)) is not None:
        inits[value] = pinned


def _pin(value: str) -> int | None:
    """A pidfd of the process ``<pid>:<start time>`` if it is still that process."""
    pid, _, started = value.partition(":")
    if not (pid.isdigit() and started.isdigit()):
        return None
    try:
        pinned = os.pidfd_open(int(pid))
    except OSError:
        return None
    try:
        if parent_and_start(int(pid))[1] == int(started):  # read after the pin: the pin's process
            return pinned
    except OSError:
        pass
    os.close(pinned)
    return None


def _quietly(action: Callable[[str], object], cid: str) -> None:
    with contextlib.suppress(Exception):
        action(cid)


@dataclass
class _Told:
    """What the runner told its watchdog, by the end of its pipe."""

    cgroups: list[tuple[int, Path]] = field(default_factory=list)
    kinds: dict[str, list[str]] = field(default_factory=lambda: {"scratch": [], "staging": [], "marked": []})
    inits: dict[str, int] = field(default_factory=dict)  # "<pid>:<start time>": its pidfd
    docker: bool = False

    def nothing(self) -> bool:
        return not (self.cgroups or self.inits or self.docker or any(self.kinds.values()))


def _listen() -> _Told:
    """Read the runner's lines until end-of-file: the runner is gone, or let this go."""
    told = _Told()
    for raw in sys.stdin.buffer:
        kind, _, value = raw.decode(errors="replace").rstrip("\n").partition("\t")
        if kind in ("init", "init-gone"):
            _note_init(told.inits, kind == "init", value)
        elif kind == "cgroups":
            version, _, parent = value.partition(":")
            told.cgroups.append((int(version), Path(parent)))
        elif kind in told.kinds:
            told.kinds[kind].append(value)
        elif kind == "docker":  # the SDK's import path, in one line or several
            told.docker = True
            sys.path.extend(entry for entry in value.split(os.pathsep) if entry and entry not in sys.path)
            if "docker" not in sys.modules:
                with contextlib.suppress(ImportError):
                    import docker  # noqa: F401 - loaded now rather than when time counts
    return told


def main(argv: list[str]) -> int:
    """The watchdog of the runner whose pid is ``argv[2]`` (``argv``: see ``_BOOT``)."""
    owner = int(argv[2])
    # Ours to ignore: only the end of the runner's pipe ends the watch.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)
    # Everything the sweep needs is loaded now, while the runner waits for "ready".
    import sandboxes.subprocess._cgroup  # noqa: F401
    from sandboxes._staging import remove_stale

    with contextlib.suppress(OSError):  # a runner that never called watch() is gone already
        os.write(1, b"r")
        os.close(1)
    try:
        runner: int | None = os.pidfd_open(owner)  # readable once the whole process is gone
    except OSError:
        runner = None
    told = _listen()
    if told.nothing():
        return 0  # the runner gave up waiting for it to start: there is nothing to sweep
    cgroups, inits, docker_used = told.cgroups, told.inits, told.docker
    scratch = [Path(value) for value in told.kinds["scratch"]]
    staging = [Path(value) for value in told.kinds["staging"]]
    marked = bool(told.kinds["marked"])
    # End of file: the runner exited or was killed. Sweep what it may have left.
    sweepers = [threading.Thread(target=_sweep_processes, args=(owner, cgroups, marked, inits))]
    if docker_used:
        sweepers.append(threading.Thread(target=_sweep_docker, args=(owner,)))
    for thread in sweepers:
        thread.start()
    _sweep_scratch(owner, scratch)
    sweepers[0].join()
    # Its descriptors close before its last thread is gone, and until then its children
    # still see it as their parent: a launcher can pass its parent check and join a cgroup
    # after the first sweep. Once the whole process is gone nothing can; sweep again.
    if runner is not None:
        select.select([runner], [], [], FULL_EXIT_WAIT_S)
        _sweep_processes(owner, cgroups, marked, inits)
    for thread in sweepers:
        thread.join()
    # Again, until gone: a sandbox still alive at the first sweep kept its folder (without
    # root, its /tmp and /dev/shm are mounted on it in the launcher's namespace).
    _sweep_scratch_until_gone(owner, scratch, SCRATCH_GONE_S)
    # Last: a staged workspace may be unmounted only once no sandbox of ours can use it.
    for root in staging:
        remove_stale(root, lambda name: name.startswith(f"{owner}-"))
    if os.geteuid() == 0:
        _sweep_leases()
    return 0


def _sweep_leases() -> None:
    """The uid lease files a killed runner left (its locks went with it), and any other's."""
    from sandboxes._identity import LEASE_DIR, sweep_unheld

    with contextlib.suppress(OSError):
        sweep_unheld(LEASE_DIR)
