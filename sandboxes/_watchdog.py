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

A watchdog that dies before the runner (killed by someone, or by the kernel short of
memory) is started again at once by a thread of the runner that waits on its pidfd, and
told again all the dead one was told; every sandbox start checks it runs, too. This
module is the runner's side; ``sandboxes._reaper`` is the watchdog process.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import select
import sys
import threading
from pathlib import Path

READY_TIMEOUT_S = 10.0
# Rootless sandboxes have no cgroup to sweep: their bubblewrap processes carry this
# variable (the sandbox's own environment is cleared), and killing bubblewrap's init
# takes the sandbox's whole pid namespace with it.
OWNER_MARK = "RUNNER_OWNER"


class _Link:
    """This process's end of its watchdog's pipe (a forked child needs a watchdog of its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner = 0  # the process whose watchdog runs (0: none does)
        self.home = 0  # the process whose lines ``told`` and ``inits`` are
        self.pid = -1  # the watchdog's
        self.write_end = -1
        self.ready_read = -1  # until the watchdog said it is ready
        self.told: set[str] = set()  # the kinds to sweep, told to every watchdog it starts
        self.inits: set[str] = set()  # the ``init`` lines of sandboxes still there, likewise
        self.queue: collections.deque[str] = collections.deque()  # init lines not yet written


_link = _Link()
# The watchdog runs isolated (-I: no PYTHON* variables, no user site, not the current
# folder) and without site (-S: the .pth files of site-packages cost more than all the
# rest of its start); the sweeps need nothing but the standard library and this package,
# whose folder arrives as argv[1].
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from sandboxes._reaper import main; sys.exit(main(sys.argv))"
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
    _tell(f"{kind}\t{value}\n")


def watch_sandbox_init(pid: int, started: int) -> None:
    """Tell the watchdog a rootless sandbox's init (bubblewrap's pid 1: ``pid`` on the
    host, started at ``started``, see ``parent_and_start``), which it pins with a pidfd and
    kills should the runner die: its death takes the sandbox's whole pid namespace. The
    tool has the init's uid: through ``/proc/1/mem``, which no seccomp filter can refuse,
    it can erase ``OWNER_MARK`` from the init's environment, clear its parent-death signal
    and make it non-dumpable, so that nothing of the init can be read any more; a pidfd
    needs nothing read. Never waits (the event loop calls it): a watchdog being started
    is told once it is ready."""
    _link.queue.append(f"init\t{pid}:{started}\n")
    _flush()


def forget_sandbox_init(pid: int, started: int) -> None:
    """The sandbox of the init ``pid`` (which started at ``started``) is gone."""
    _link.queue.append(f"init-gone\t{pid}:{started}\n")
    _flush()


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


def _tell(line: str) -> None:
    """Write ``line`` to the watchdog, started first if need be (``ensure``), unless it was
    told already; and to every watchdog started after it.

    Raises:
        OSError: the watchdog could not be started.
    """
    with _link.lock:
        for attempt in (1, 2):
            _running()
            if line in _link.told:
                break
            try:
                os.write(_link.write_end, line.encode())
            except BrokenPipeError:
                if attempt == 2:  # it died between the check and the write: once more
                    raise
                continue
            _link.told.add(line)
            break
    _flush()


def ensure() -> None:
    """Make sure this process's watchdog runs: one that died is started again, and told
    again all it was told, before the caller starts another sandbox.

    Raises:
        OSError: it could not be started; the caller must not start a sandbox.
    """
    with _link.lock:
        _running()
    _flush()


def _running() -> None:
    """``ensure``, called with the lock held."""
    if _link.owner == os.getpid() and _link.ready_read < 0 and _gone():
        os.close(_link.write_end)
        _link.write_end, _link.owner = -1, 0
    if _link.owner != os.getpid():
        _spawn()
    if _link.ready_read >= 0:
        _await_ready()
        for line in (*sorted(_link.told), *sorted(_link.inits)):  # a new one is told all
            os.write(_link.write_end, line.encode())
        pidfd = os.pidfd_open(_link.pid)
        threading.Thread(
            target=_monitor, args=(_link.pid, pidfd), name="watchdog-monitor", daemon=True
        ).start()


def _flush() -> None:
    """Write the queued init lines, unless another thread holds the link: it writes them
    (each holder flushes after it lets go, so none is left behind)."""
    while _link.queue and _link.lock.acquire(blocking=False):
        try:
            if _link.owner != os.getpid() or _link.ready_read >= 0:
                return  # not running here yet: whoever starts it writes the queue
            while _link.queue:
                line = _link.queue.popleft()
                kind, _, value = line.partition("\t")
                if kind == "init":
                    _link.inits.add(line)
                else:
                    _link.inits.discard(f"init\t{value}")
                with contextlib.suppress(OSError):  # died: the next one is told ``inits``
                    os.write(_link.write_end, line.encode())
        finally:
            _link.lock.release()


def _monitor(pid: int, pidfd: int) -> None:
    """Wait until the watchdog ``pid`` is gone; then start another at once, so that the
    sandboxes already running (a long call, a session, a pool) are guarded again without
    waiting for the next one to start."""
    try:
        _readable(pidfd, None)
    finally:
        os.close(pidfd)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # ours (posix_spawn): reaped, no zombie is left
    with _link.lock:
        if _link.pid != pid or _link.owner != os.getpid():
            return  # replaced already, or the runner let it go
        with contextlib.suppress(OSError):  # else the next sandbox's ``ensure`` tries again
            _running()
    _flush()


def _readable(fd: int, timeout_s: float | None) -> bool:
    """Wait until ``fd`` is readable (None: however long); poll, not select: a server's
    descriptors may number past select's 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))


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
        pid = os.posix_spawn(
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
    if _link.home != os.getpid():  # a forked child: its parent's watchdog was told those
        _link.told.clear()
        _link.inits.clear()
        _link.queue.clear()
        _link.home = os.getpid()
    _link.owner, _link.pid = os.getpid(), pid
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
        if not _readable(ready_read, READY_TIMEOUT_S) or os.read(ready_read, 1) != b"r":
            os.close(_link.write_end)  # its end-of-file: a late watchdog exits at once
            _link.write_end = -1
            _link.owner = 0
            raise OSError(errno.ETIMEDOUT, "the watchdog did not start")
    finally:
        os.close(ready_read)
        _link.ready_read = -1
