"""A host uid of its own for every sandbox alive at once.

Sandboxes that share a uid share everything the kernel keys by uid: key rings, the
per-user quotas (inotify watches, pipe pages, keys, processes), and the right to signal,
trace and read the memory of each other's processes. So each sandbox leases one uid from
a range the runner owns, as isolate's box ids and systemd's DynamicUser= do: a lease is
an exclusive ``flock`` on ``<lease dir>/<uid>``, held by the runner for the sandbox's
life and released by the kernel when the runner dies. Several runners on one host share
the lease directory and so never hand out the same uid at once.

Every sandbox has the one group ``SANDBOX_GID``: group access is how sandboxes share a
workspace they were granted, which is shared by design; nothing else is keyed by it.

A runner killed mid-call frees its leases at once, while its sandboxes live until its
watchdog kills them (well under a second). Leases are handed out round-robin from a
random start, so a uid just freed is not the next one taken.

A released lease's file is removed, so the directory holds about as many files as uids
are in use (not one per uid ever used). The holder unlinks it while it still holds the
lock; a taker that opened the file just before may get the lock on that unlinked inode
once it is closed, so every taker checks, holding the lock, that the path still names
the inode it locked, and starts over when it does not. Only a holder ever unlinks, so the
one lock on the inode the path names is the lease. A runner that died leaves its files
(round-robin from a random start, a taker seldom meets them): its watchdog then removes
every file no one holds, each as a holder would (``sweep_unheld``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import os
import random
import threading
from pathlib import Path

from sandboxes._owners import open_own_folder
from sandboxes.base import SandboxUnavailable

# systemd leaves 1879048192..2147483647 unassigned; this block of it is ours.
UID_BASE = 1_900_000_000
UID_COUNT = 65_536
SANDBOX_GID = UID_BASE - 1


class NoFreeIdentity(Exception):
    """Every uid of the range is leased right now."""


# A taker that keeps finding a uid's file replaced under its lock moves on to the next uid.
SAME_UID_TRIES = 3


class IdentityLease:
    """One leased uid; ``release`` gives it back (also safe twice)."""

    def __init__(self, uid: int, fd: int | None, directory: int | None = None) -> None:
        self.uid = uid
        self.gid = SANDBOX_GID
        self._fd = fd
        self._directory = directory  # the lease directory's descriptor: the file is removed

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._directory is not None:
                # Still holding the lock: no other holder of this inode can exist, and a
                # taker that locks it after the close sees that the path no longer names it.
                with contextlib.suppress(OSError):
                    os.unlink(str(self.uid), dir_fd=self._directory)
        finally:
            os.close(fd)  # closing the only descriptor drops the flock


class IdentityPool:
    """Leases distinct uids, or the runner's own uid when it cannot change user."""

    def __init__(self, lease_dir: Path, base: int = UID_BASE, count: int = UID_COUNT) -> None:
        self._dir = lease_dir
        self._base = base
        self._count = count
        self._cursor = itertools.count(random.randrange(count))  # noqa: S311 - spreading, not secrecy
        self._lock = threading.Lock()
        self._dir_fd: int | None = None

    def _directory(self) -> int:
        if self._dir_fd is None:
            with contextlib.suppress(FileExistsError):
                self._dir.mkdir(mode=0o700)
            self._dir_fd = open_own_folder(self._dir)
        return self._dir_fd

    def lease(self) -> IdentityLease:
        """A uid no other live sandbox on this host has.

        Raises:
            NoFreeIdentity: all ``count`` uids are in use.
            OSError: the lease directory cannot be used.
        """
        if os.geteuid() != 0:
            return IdentityLease(os.getuid(), None)  # cannot be anyone else: bwrap maps us
        with self._lock:
            directory = self._directory()
            for _ in range(self._count):
                uid = self._base + next(self._cursor) % self._count
                fd = _lock_file(str(uid), directory)
                if fd is not None:
                    return IdentityLease(uid, fd, directory)
        raise NoFreeIdentity(f"all {self._count} sandbox uids are in use")


def _lock_file(name: str, directory: int) -> int | None:
    """The descriptor of lease file ``name``, locked, and still the file the path names;
    None when another sandbox holds it (or it kept being released and removed under us)."""
    for _ in range(SAME_UID_TRIES):
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _names(name, directory, fd):
            return fd
        os.close(fd)  # an inode its holder removed on release: the lock on it is no lease
    return None


def _names(name: str, directory: int, fd: int) -> bool:
    """Does ``name`` in ``directory`` still name the file open as ``fd``?"""
    try:
        named = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    locked = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino)


def sweep_unheld(lease_dir: Path) -> int:
    """Remove the lease files in ``lease_dir`` that no one holds, each taken and removed
    as its holder's release would; how many went."""
    directory = open_own_folder(lease_dir)
    removed = 0
    try:
        for name in os.listdir(directory):  # noqa: PTH208 - by descriptor
            try:
                fd = _lock_file(name, directory) if name.isdigit() else None
            except OSError:  # not a lease file (a folder, a link): not ours to remove
                continue
            if fd is not None:
                IdentityLease(int(name), fd, directory).release()
                removed += 1
    finally:
        os.close(directory)
    return removed


# One lease directory per host, whatever state folder a runner uses, so runners agree.
LEASE_DIR = Path("/run/runner-uids")


@functools.cache
def shared_identities() -> IdentityPool:
    """The process's pool over the host-wide lease directory."""
    return IdentityPool(LEASE_DIR)


def lease_identity() -> IdentityLease:
    """A uid for one sandbox from the host-wide pool.

    Raises:
        SandboxUnavailable: the pool is exhausted or its lease folder cannot be used.
    """
    try:
        return shared_identities().lease()
    except (NoFreeIdentity, OSError) as exc:
        raise SandboxUnavailable(f"no sandbox identity: {exc}") from exc
