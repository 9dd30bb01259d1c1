"""Tool folders bound once, in a thread of the runner that has a mount namespace of its own.

As root, bubblewrap runs as the sandbox user, who may have no search right on a tool's
folder (a tool under ``/root``, or in a ``mkdtemp`` folder). The launcher can bind the
folder onto a fixed point in a mount namespace made for the call (``unshare`` and
``mount``: two more programs per call, ~2 ms of the machine's CPU out of ~50 measured by
``bench/call_cpu.py``).

This does that binding once per folder instead. One thread of the runner moves into a
mount namespace of its own: ``unshare(CLONE_NEWNS)`` applies to the calling thread only.
Its mounts are slaves of the host's, so nothing mounted there is seen by anyone else.
There each such folder is bound read-only onto a point of its own under the state folder,
and the sandboxes of those tools are started from this thread, so their launcher and
bubblewrap inherit the binds.

The tool never sees them: bubblewrap makes the tool a mount namespace of its own, moves
into a fresh root and unmounts the one it came from, so the tool finds only its own
folder, at ``/tool``.

Only for hardened sandboxes without a workspace. A degraded tool would run in this
namespace and could read every folder bound here, and a workspace is bound for its call
alone. Both keep the launcher's own namespace.

A folder is bound again when the path names another folder now (a tool folder replaced):
the old point stays, since a launcher may still be about to bind it, and the points are
at most ``MAX_POINTS``. Past that, and wherever this namespace's view of a path differs
from the caller's (a filesystem mounted on the host after the thread began, when the
host's mounts do not propagate), ``point`` says no and the launcher stages the folder
itself, as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from sandboxes._prepare import submit
from sandboxes.cancellation import finish_shielded

T = TypeVar("T")

CLONE_NEWNS = 0x00020000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SLAVE = 0x80000
# Tool folders bound in one runner's life (a policy reload binds a changed folder again).
MAX_POINTS = 1024

FolderId = tuple[int, int]
_this_thread = threading.local()  # ``own_namespace``: on a launch thread, in its namespace


class NoNamespace(Exception):
    """This machine cannot give the thread a mount namespace (the launcher stages instead)."""


def folder_id(path: Path | int) -> FolderId:
    """What tells one folder from another: its device and inode (``path`` or descriptor)."""
    st = os.fstat(path) if isinstance(path, int) else path.stat()
    return st.st_dev, st.st_ino


class StagedFolders:
    """The thread, the binds it made, and a way to run work on it.

    Made with no I/O; the thread starts (and enters its namespace) on first use. After
    ``shutdown`` a later use starts a new one.
    """

    def __init__(self, points_root: Path) -> None:
        self._root = points_root
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.problem: str | None = None  # why this machine cannot have it (then never again)
        self._points: dict[Path, tuple[Path, FolderId]] = {}
        self._made = 0

    @property
    def available(self) -> bool:
        return self.problem is None

    def run(self, work: Callable[[], T]) -> T:
        """``work()`` on the thread (blocking).

        Raises:
            NoNamespace: no mount namespace for the thread here.
            SandboxUnavailable: the backend is closing.
        """
        return submit(self._started(), work).result()

    async def arun(self, work: Callable[[], T]) -> T:
        """``work()`` on the thread, awaited. A caller cancelled meanwhile (any number of
        times) still waits for it to end: what it started must be known before the caller
        cleans up.

        Raises:
            NoNamespace, SandboxUnavailable: as ``run``.
        """
        pool = self._pool  # read once: a close may set it to None meanwhile
        if pool is None:
            pool = await asyncio.to_thread(self._started)
        return await finish_shielded(asyncio.wrap_future(submit(pool, work)))

    def point(self, folder: Path, expected: FolderId) -> Path | None:
        """Where ``folder`` is bound in this thread's namespace, bound now if need be; None
        when it cannot be (the launcher then stages it). On the thread only.

        ``expected`` is the folder's id as the caller's namespace sees it.

        Raises:
            OSError: the bind failed.
        """
        if not getattr(_this_thread, "own_namespace", False):
            # Anywhere else the bind would land in the host's namespace, for everyone.
            raise RuntimeError("tool folders are bound on the launch thread only")
        known = self._points.get(folder)
        if known is not None and known[1] == expected and folder_id(known[0]) == expected:
            return known[0]
        if self._made >= MAX_POINTS or not folder.is_absolute():
            return None
        fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if folder_id(fd) != expected:
                return None  # this namespace sees another folder at that path
            point = self._root / str(self._made)
            self._made += 1
            point.mkdir(parents=True, exist_ok=True)  # under the backend's folder of points (0755)
            point.chmod(0o755)  # whatever the runner's umask: the sandbox user passes here
            # The descriptor, not the path: bound is what was checked (as root, a path
            # could be swapped for a symlink between the check and the mount).
            _mount(f"/proc/self/fd/{fd}", point, MS_BIND)
            _mount(None, point, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        finally:
            os.close(fd)
        self._points[folder] = (point, expected)
        return point

    def shutdown(self) -> None:
        """Let the thread end (blocking), after the work under way. Its namespace, and the
        binds in it, go with the last process started from it."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            if self._pool is None:  # not started again meanwhile
                self._points.clear()

    def _started(self) -> ThreadPoolExecutor:
        with self._lock:
            if self.problem is not None:
                raise NoNamespace(self.problem)
            if self._pool is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix="runner-launch")
                try:
                    pool.submit(_enter_own_namespace).result()
                except OSError as exc:
                    pool.shutdown(wait=True)  # the thread ends, and its namespace with it
                    self.problem = f"cannot make the launch thread's mount namespace: {exc.strerror}"
                    raise NoNamespace(self.problem) from exc
                self._pool, self._made = pool, 0
            return self._pool


def _enter_own_namespace() -> None:
    """Move the calling thread into a mount namespace of its own whose mounts receive the
    host's changes and never send any back."""
    if _libc().unshare(CLONE_NEWNS) != 0:
        raise _os_error("unshare")
    # Until this succeeds the copies are peers of the host's mounts: if it fails, the
    # thread must end (its caller shuts it down) without mounting anything.
    _mount(None, Path("/"), MS_REC | MS_SLAVE)
    _this_thread.own_namespace = True


def _mount(source: str | None, target: Path, flags: int) -> None:
    encoded = source.encode() if source is not None else None
    if _libc().mount(encoded, str(target).encode(), None, flags, None) != 0:
        raise _os_error(f"mount {target}")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _os_error(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, os.strerror(errno), what)
