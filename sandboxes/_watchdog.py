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
memory) is started again by a thread of the runner that watches its pipe (at once, or a
second after the dead one started), and told again all the dead one was told; every
sandbox start checks it runs, too. This module is the runner's side; ``sandboxes._reaper``
is the watchdog process.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

READY_TIMEOUT_S = 10.0
# A watchdog that lived shorter than this is started again only once it has passed: one
# that keeps dying (killed over and over, out of memory) does not take a core.
RESTART_PAUSE_S = 1.0
# How often the monitor looks for init lines a full pipe left queued (a watchdog that
# was slow to read, or stopped) when nothing else woke it.
MONITOR_POLL_S = 0.25
# Rootless sandboxes have no cgroup to sweep: their bubblewrap processes carry this
# variable (the sandbox's own environment is cleared), and killing bubblewrap's init
# takes the sandbox's whole pid namespace with it.
OWNER_MARK = "RUNNER_OWNER"


class _Link:
    """This process's end of its watchdog's pipe (a forked child needs a watchdog of its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner = 0  # the process whose watchdog runs (0: none is running)
        self.pid = -1  # the watchdog's
        self.started = 0.0  # when it was started (time.monotonic)
        self.write_end = -1  # non-blocking: a stopped watchdog never blocks a writer
        self.ready_read = -1  # until the watchdog said it is ready
        self.private: set[int] = set()  # more of ours a forked child must close (see _forked)
        self.late: list[int] = []  # watchdogs that never said they were ready, to reap
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


def _forked() -> None:
    """In a child forked (not executed) from this process: its parent's watchdog and
    sandboxes are not its own. The copies of the parent's pipe ends are closed (else the
    parent's watchdog would not see end-of-file when the parent dies), the lock is new
    (another thread may have held it at the fork), the kinds to sweep are kept (the
    sweeps go by the owner's pid: the child's own) and the parent's inits are dropped."""
    for inherited in (_link.write_end, _link.ready_read, *_link.private):
        if inherited >= 0:
            with contextlib.suppress(OSError):
                os.close(inherited)
    _link.lock = threading.Lock()
    _link.owner, _link.pid, _link.write_end, _link.ready_read = 0, -1, -1, -1
    _link.private = set()
    _link.late = []
    _link.inits.clear()
    _link.queue.clear()


os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def _holding() -> Iterator[None]:
    """The link's lock; once let go, the queued init lines are written (a line queued
    while the lock was held is left for its holder)."""
    try:
        with _link.lock:
            yield
    finally:
        _flush()


def prestart() -> None:
    """Start this process's watchdog now without waiting for it, so that it boots while
    the caller goes on (loading tools); the first ``watch`` waits until it is ready. A
    failure to start is left for that ``watch`` to meet again and raise."""
    with _holding():
        if _link.owner != os.getpid():
            with contextlib.suppress(OSError):
                _spawn()


def watch(kind: str, value: str = "") -> None:
    """Make sure this process has a watchdog, and tell it to sweep ``kind``/``value``.

    ``kind`` is ``cgroups`` (value: ``<version>:<parent dir>``), ``scratch`` (a folder of
    ``<pid>-*`` entries), ``staging`` (a folder of staged workspaces), ``marked``
    (processes carrying ``OWNER_MARK``) or ``docker``; a sandbox's init is told by
    ``watch_sandbox_init``. Every watchdog started later is told again.

    Raises:
        OSError: the watchdog could not be started; the caller must not start a sandbox.
    """
    lines = _lines(kind, value)
    with _holding():
        for attempt in (1, 2):
            _running()
            try:
                for line in lines:
                    if line not in _link.told:
                        _write(line, READY_TIMEOUT_S)
                        _link.told.add(line)
                return
            except BrokenPipeError:
                if attempt == 2:  # it died between the check and the write: once more
                    raise


def _lines(kind: str, value: str) -> list[str]:
    """The lines that tell ``kind``/``value``, each shorter than PIPE_BUF (so written whole
    or not at all): the Docker SDK's import path may take several.

    Raises:
        OSError: a value too long for one line.
    """
    if kind != "docker" or value:
        lines = [f"{kind}\t{value}\n"]
    else:
        lines, entries = [], _import_path()
        while entries:
            count = 1
            while count < len(entries) and len(os.pathsep.join(entries[: count + 1])) < select.PIPE_BUF // 2:
                count += 1
            lines.append(f"docker\t{os.pathsep.join(entries[:count])}\n")
            entries = entries[count:]
        lines = lines or ["docker\t\n"]
    if any(len(line.encode()) >= select.PIPE_BUF for line in lines):
        raise OSError(errno.ENAMETOOLONG, f"a {kind} path too long for the watchdog")
    return lines


def watch_sandbox_init(pid: int, started: int) -> None:
    """Tell the watchdog a rootless sandbox's init (bubblewrap's pid 1: ``pid`` on the
    host, started at ``started``, see ``parent_and_start``), which it pins with a pidfd and
    kills should the runner die: its death takes the sandbox's whole pid namespace. The
    tool has the init's uid: through ``/proc/1/mem``, which no seccomp filter can refuse,
    it can erase ``OWNER_MARK`` from the init's environment, clear its parent-death signal
    and make it non-dumpable, so that nothing of the init can be read any more; a pidfd
    needs nothing read. Never waits (the event loop calls it): while another thread holds
    the link (a watchdog being started), that thread writes it."""
    _link.queue.append(f"init\t{pid}:{started}\n")
    _flush()


def forget_sandbox_init(pid: int, started: int) -> None:
    """The sandbox of the init ``pid`` (which started at ``started``) is gone."""
    _link.queue.append(f"init-gone\t{pid}:{started}\n")
    _flush()


def ensure() -> None:
    """Make sure this process's watchdog runs: one that died and was not started again
    yet (its monitor pauses after a short life) is started now, before the caller starts
    another sandbox.

    Raises:
        OSError: it could not be started; the caller must not start a sandbox.
    """
    with _holding():
        _running()


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


def _running() -> None:
    """``ensure``, called with the lock held. A new watchdog is told all the last one was:
    the kinds at once, the inits through the queue."""
    for late in list(_link.late):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(late, os.WNOHANG)[0] == 0:
                continue
        _link.late.remove(late)
    if _link.owner == os.getpid() and _link.ready_read < 0 and _gone():
        dead, _link.write_end, _link.owner = _link.write_end, -1, 0
        os.close(dead)
    if _link.owner != os.getpid():
        _spawn()
    if _link.ready_read >= 0:
        _await_ready()
        _link.queue.extendleft(sorted(_link.inits, reverse=True))
        watched = os.dup(_link.write_end)
        _link.private.add(watched)
        threading.Thread(target=_monitor, args=(_link.pid, watched), daemon=True).start()
        for line in sorted(_link.told):  # should it die meanwhile, the monitor starts another
            _write(line, READY_TIMEOUT_S)


def _write(line: str, wait_s: float | None) -> None:
    """Write ``line`` (shorter than PIPE_BUF: whole or not at all), waiting at most
    ``wait_s`` for room in the pipe (None: not at all).

    Raises:
        BlockingIOError: no room (a watchdog stopped, not dead).
        BrokenPipeError: it died.
    """
    for attempt in (1, 2):
        try:
            os.write(_link.write_end, line.encode())
            return
        except BlockingIOError:
            poller = select.poll()
            poller.register(_link.write_end, select.POLLOUT)
            if attempt == 2 or wait_s is None or not poller.poll(int(wait_s * 1000)):
                raise


def _flush() -> None:
    """Write the queued init lines, unless another thread holds the link (it writes them
    once it lets go) or no watchdog runs yet (the one who starts it writes them)."""
    while _link.queue and _link.lock.acquire(blocking=False):
        try:
            if _link.owner != os.getpid() or _link.ready_read >= 0:
                return
            while _link.queue:
                line = _link.queue[0]
                kind, _, value = line.partition("\t")
                if kind == "init":
                    _link.inits.add(line)
                else:
                    _link.inits.discard(f"init\t{value}")
                try:
                    _write(line, None)
                except BlockingIOError:
                    return  # left queued: a stopped watchdog is never waited for here
                except OSError:
                    pass  # it died: the next one is told ``inits``
                _link.queue.popleft()
        finally:
            _link.lock.release()


def _monitor(pid: int, watched: int) -> None:
    """Wait until the watchdog ``pid`` is gone (the pipe shows an error once its reader
    is); then start another, so that the sandboxes already running (a long call, a
    session, a pool) are guarded again without waiting for the next one to start. Till
    then, write the init lines a full pipe left queued as soon as there is room."""
    poller = select.poll()
    while True:
        poller.register(watched, select.POLLOUT if _link.queue else 0)  # errors come unasked
        events = [mask for _, mask in poller.poll(int(MONITOR_POLL_S * 1000))]
        if any(mask & (select.POLLERR | select.POLLHUP) for mask in events):
            break
        if _link.queue:
            _flush()
    reaped, deadline = False, time.monotonic() + 1.0
    while not reaped and time.monotonic() < deadline:  # ours (posix_spawn): not a zombie
        try:
            reaped = os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            reaped = True
        if not reaped:
            time.sleep(0.01)  # its descriptors close just before it exits
    time.sleep(max(0.0, _link.started + RESTART_PAUSE_S - time.monotonic()))
    with _holding():
        _link.private.discard(watched)
        os.close(watched)
        if not reaped:
            _link.late.append(pid)
        if _link.pid != pid or _link.owner != os.getpid():
            return  # replaced already
        with contextlib.suppress(OSError):  # else the next sandbox's ``ensure`` tries again
            _running()


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
        if Path(entry).is_absolute()
        and entry != here
        and not set(entry) & {os.pathsep, "\t", "\n"}
        and len(entry.encode()) < select.PIPE_BUF // 2
    ]


def _spawn() -> None:
    """Start the watchdog; ``_await_ready`` finishes the start. Called with the lock held.

    Raises:
        OSError: it could not be spawned.
    """
    read_end, write_end = os.pipe()  # both close-on-exec: no launcher inherits them
    _link.private.update((read_end, write_end))
    ready_read, ready_write = os.pipe()
    _link.private.update((ready_read, ready_write))
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
        _close(write_end, ready_read)
        raise
    finally:
        _close(read_end, ready_write)
    os.set_blocking(write_end, False)
    _link.owner, _link.pid, _link.started = os.getpid(), pid, time.monotonic()
    _link.write_end, _link.ready_read = write_end, ready_read
    _link.private -= {write_end, ready_read}


def _close(*fds: int) -> None:
    """Close descriptors of ``private``: dropped from it first (a fork meanwhile must not
    close a number already reused)."""
    _link.private -= set(fds)
    for fd in fds:
        os.close(fd)


def _await_ready() -> None:
    """Wait until the watchdog can sweep: a runner killed while its watchdog is still
    starting (slow on a loaded host) would otherwise leave its first sandboxes unswept.
    Called with the lock held.

    Raises:
        OSError: it did not become ready; the next ``watch`` starts another.
    """
    ready_read = _link.ready_read
    try:
        poller = select.poll()
        poller.register(ready_read, select.POLLIN)  # not select(): descriptors past 1024
        if not poller.poll(int(READY_TIMEOUT_S * 1000)) or os.read(ready_read, 1) != b"r":
            unready, _link.write_end, _link.owner = _link.write_end, -1, 0
            os.close(unready)  # its end-of-file: told nothing, it exits at once
            _link.late.append(_link.pid)
            raise OSError(errno.ETIMEDOUT, "the watchdog did not start")
    finally:
        _link.ready_read = -1
        os.close(ready_read)
