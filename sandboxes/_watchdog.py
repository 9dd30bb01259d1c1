"""The reaper: nothing a runner started outlives the runner, however it dies.

A parent-death signal alone does not hold. It is armed only once bubblewrap runs (a
runner killed a few milliseconds after a spawn leaves the launcher orphaned), a tool may
clear it in a process it can ptrace, and a Docker container is the daemon's child, not
ours. So the first backend a runner process uses starts one small watchdog process of
its own: in a session of its own (a Ctrl-C or a kill of the runner's process group does
not reach it), reading a pipe whose only write end the runner holds. The runner tells it
what to sweep (its per-call cgroup parents, scratch root, that Docker is in use). When the
pipe reaches end-of-file, the runner is gone, killed or not, and the watchdog at once kills
every call cgroup and container named or labelled with the runner's pid; once the runner's
last thread has left the kernel too (a pidfd says so) it sweeps the cgroups once more,
then exits.

The launcher closes the remaining gap: it joins the call's cgroup first and then checks
that its parent is still the runner, so a launcher the sweep missed exits by itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

READY_TIMEOUT_S = 10.0
# How long a dead runner's last threads may take to leave the kernel (a v1 cgroup
# operation waits out an RCU grace period) before the second sweep goes ahead anyway.
FULL_EXIT_WAIT_S = 10.0
# A container create the runner sent just before dying may land after the first sweep.
DOCKER_SWEEPS_S = (0.0, 0.5, 2.0)
# How long the last sweep of the scratch folders tries while one is left (its sandbox
# was killed, its namespaces are going).
SCRATCH_GONE_S = 3.0


class _Link:
    """This process's end of its watchdog's pipe (a forked child needs a watchdog of its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner = 0
        self.write_end = -1
        self.ready_read = -1  # until the watchdog said it is ready
        self.told: set[str] = set()
        self.inits: set[str] = set()  # the init lines of sandboxes still there


_link = _Link()
# The watchdog runs isolated (-I: no PYTHON* variables, no user site, not the current
# folder) and without site (-S: the .pth files of site-packages cost more than all the
# rest of its start); the sweeps need nothing but the standard library and this package,
# whose folder arrives as argv[1].
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from sandboxes._watchdog import main; sys.exit(main(sys.argv))"
)


def prestart() -> None:
    """Start this process's watchdog now without waiting for it, so that it boots while
    the caller goes on (loading tools); the first ``watch`` waits until it is ready. A
    failure to start is left for that ``watch`` to meet again and raise."""
    with _link.lock:
        if _link.owner != os.getpid():
            with contextlib.suppress(OSError):
                _spawn()


def watch(kind: str, value: str = "") -> None:
    """Make sure this process has a watchdog, and tell it to sweep ``kind``/``value``.

    ``kind`` is ``cgroups`` (value: ``<version>:<parent dir>``), ``scratch`` (a folder of
    ``<pid>-*`` entries), ``staging`` (a folder of staged workspaces), ``marked``
    (processes carrying ``OWNER_MARK``) or ``docker``; a sandbox's init is told by
    ``watch_sandbox_init``.

    Raises:
        OSError: the watchdog could not be started; the caller must not start a sandbox.
    """
    if kind == "docker" and not value:
        value = os.pathsep.join(_import_path())
    _tell(f"{kind}\t{value}\n", once=True)


def watch_sandbox_init(pid: int, started: int) -> None:
    """Tell the watchdog a rootless sandbox's init (bubblewrap's pid 1: ``pid`` on the
    host, started at ``started``, see ``parent_and_start``), which it pins with a pidfd and
    kills should the runner die: its death takes the sandbox's whole pid namespace. The
    tool has the init's uid: through ``/proc/1/mem``, which no seccomp filter can refuse,
    it can erase ``OWNER_MARK`` from the init's environment, clear its parent-death signal
    and make it non-dumpable, so that nothing of the init can be read any more; a pidfd
    needs nothing read.

    Raises:
        OSError: the watchdog could not be started.
    """
    _tell(f"init\t{pid}:{started}\n")


def forget_sandbox_init(pid: int, started: int) -> None:
    """The sandbox of the init ``pid`` (which started at ``started``) is gone."""
    with contextlib.suppress(OSError):
        _tell(f"init-gone\t{pid}:{started}\n")


def parent_and_start(pid: int) -> tuple[int, int]:
    """The pid of its parent and when it started, in clock ticks since boot, from one read
    of ``/proc/PID/stat`` (readable whoever owns the process and however it set itself;
    two reads could be of two processes, should the pid be reused between them): a pid
    and its start time name a process.

    Raises:
        OSError: no such process.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError) as exc:
        raise OSError(errno.ESRCH, f"unreadable status of {pid}") from exc


def _tell(line: str, once: bool = False) -> None:
    """Write ``line`` to the watchdog, started first if need be; ``once``: unless it was
    told already (a sandbox's init is told once anyway, and its pid comes back). A
    watchdog that died (killed by someone, or by the kernel short of memory) is started
    again first (``ensure``).

    Raises:
        OSError: the watchdog could not be started.
    """
    with _link.lock:
        _running()
        if once and line in _link.told:
            return
        os.write(_link.write_end, line.encode())
        if once:
            _link.told.add(line)
        elif line.startswith("init\t"):
            _link.inits.add(line)
        elif line.startswith("init-gone\t"):
            _link.inits.discard("init" + line.removeprefix("init-gone"))


def ensure() -> None:
    """Make sure this process's watchdog runs: one that died is started again, and told
    again all it was told, before the caller starts another sandbox.

    Raises:
        OSError: it could not be started; the caller must not start a sandbox.
    """
    with _link.lock:
        _running()


def _running() -> None:
    """``ensure``, called with the lock held."""
    if _link.owner == os.getpid() and _link.ready_read < 0 and _gone():
        os.close(_link.write_end)
        _link.write_end, _link.owner = -1, 0
    if _link.owner != os.getpid():
        _spawn()
    if _link.ready_read >= 0:
        _await_ready()
        for told in (*sorted(_link.told), *sorted(_link.inits)):  # a restarted one's due
            os.write(_link.write_end, told.encode())


def _gone() -> bool:
    """Whether the watchdog's end of the pipe is closed: it died."""
    poller = select.poll()
    poller.register(_link.write_end, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _import_path() -> list[str]:
    # Where this process finds the Docker SDK, for the watchdog's Docker sweep (it starts
    # without site-packages): never the current folder, and nothing that would break a line.
    here = str(Path.cwd())
    return [
        entry
        for entry in sys.path
        if Path(entry).is_absolute() and entry != here and not set(entry) & {os.pathsep, "\t", "\n"}
    ]


def _spawn() -> None:
    """Start the watchdog; ``_await_ready`` finishes the start. Called with the lock held.

    Raises:
        OSError: it could not be spawned.
    """
    read_end, write_end = os.pipe()  # both close-on-exec: no launcher inherits them
    ready_read, ready_write = os.pipe()
    package_root = str(Path(__file__).resolve().parent.parent)
    try:
        # posix_spawn rather than Popen: no object whose finalizer complains that the
        # watchdog still runs; it is meant to outlive every object of ours.
        os.posix_spawn(
            sys.executable,
            [sys.executable, "-I", "-S", "-c", _BOOT, package_root, str(os.getpid())],
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, read_end, 0),
                (os.POSIX_SPAWN_DUP2, ready_write, 1),
                # never hold a caller's stderr pipe open past our exit
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
            setsid=True,
        )
    except OSError:
        os.close(write_end)
        os.close(ready_read)
        raise
    finally:
        os.close(read_end)
        os.close(ready_write)
    if _link.owner not in (0, os.getpid()):
        # A forked child's copies of its parent's ends: closing them here is what lets the
        # parent's watchdog see end-of-file when the parent dies.
        for inherited in (_link.write_end, _link.ready_read):
            if inherited >= 0:
                with contextlib.suppress(OSError):
                    os.close(inherited)
        _link.told.clear()  # the parent's watchdog was told those, not this child's
        _link.inits.clear()
    _link.owner = os.getpid()
    _link.write_end = write_end
    _link.ready_read = ready_read


def _await_ready() -> None:
    """Wait until the watchdog can sweep: a runner killed while its watchdog is still
    starting (slow on a loaded host) would otherwise leave its first sandboxes unswept.
    Called with the lock held.

    Raises:
        OSError: it did not become ready; the next ``watch`` starts another.
    """
    ready_read = _link.ready_read
    try:
        ready, _, _ = select.select([ready_read], [], [], READY_TIMEOUT_S)
        if not ready or os.read(ready_read, 1) != b"r":
            os.close(_link.write_end)  # its end-of-file: a late watchdog exits at once
            _link.write_end = -1
            _link.owner = 0
            raise OSError(errno.ETIMEDOUT, "the watchdog did not start")
    finally:
        os.close(ready_read)
        _link.ready_read = -1


# -- the watchdog process -----------------------------------------------------------------


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
    deadline = time.monotonic() + within_s
    while True:
        _sweep_scratch(owner, roots)
        left = False
        for root in roots:
            with contextlib.suppress(OSError):
                left = left or any(child.name.startswith(f"{owner}-") for child in root.iterdir())
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _sweep_docker(owner: int) -> None:
    try:
        from docker import APIClient
        from docker.utils import kwargs_from_env

        from sandboxes.docker._client import LABEL_OWNER
    except ImportError:
        return
    try:
        client = APIClient(**kwargs_from_env(), timeout=10)
    except Exception:  # no daemon: nothing of ours can be running there
        return
    label = f"{LABEL_OWNER}={owner}"
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
                _quietly(lambda cid: client.remove_container(cid, force=True), cid)


# Rootless sandboxes have no cgroup to sweep: their bubblewrap processes carry this
# variable (the sandbox's own environment is cleared), and killing bubblewrap's init
# takes the sandbox's whole pid namespace with it.
OWNER_MARK = "RUNNER_OWNER"


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
    cgroups: list[tuple[int, Path]] = []
    told: dict[str, list[str]] = {"scratch": [], "staging": [], "marked": []}
    inits: dict[str, int] = {}  # "<pid>:<start time>": its pidfd
    docker_used = False
    for raw in sys.stdin.buffer:
        kind, _, value = raw.decode(errors="replace").rstrip("\n").partition("\t")
        if kind in ("init", "init-gone"):
            _note_init(inits, kind == "init", value)
        elif kind == "cgroups":
            version, _, parent = value.partition(":")
            cgroups.append((int(version), Path(parent)))
        elif kind in told:
            told[kind].append(value)
        elif kind == "docker" and not docker_used:
            docker_used = True
            sys.path.extend(entry for entry in value.split(os.pathsep) if entry and entry not in sys.path)
            with contextlib.suppress(ImportError):
                import docker  # noqa: F401 - loaded now rather than when time counts
    scratch = [Path(value) for value in told["scratch"]]
    staging = [Path(value) for value in told["staging"]]
    marked = bool(told["marked"])
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
    return 0
