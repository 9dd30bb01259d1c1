"""The folder every hardened sandbox sees at ``/run/runner-etc``: its ``/etc`` files.

Two kinds: the runner's own (a two-line ``passwd`` and ``group``, the ``resolv.conf`` of
slirp4netns) and copies of the few host files ordinary programs read (``COPIED``). The
sandbox's ``/etc`` names each through a symlink into this one folder, bound once: a
read-only bind per file cost bubblewrap ~0.2 ms of CPU each on every call (measured:
0.85-1.1 ms for the five it had), on the two cores every call shares.

A copy is made again when the host's file changes (``refresh``, before each sandbox: one
``lstat`` per file), so a long-lived runner follows an ``apt install`` (``ld.so.cache``)
or a new time zone. Files are replaced by an atomic rename: another runner, or a sandbox
starting now, sees the old file or the new one, never half of one. A host file that is
a symlink (``/etc/localtime``) is copied as the symlink, to be followed inside, where
``/usr`` is the host's. Only regular files and symlinks are copied; nothing else under
``/etc`` is ever read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

# Host files the sandbox gets a copy of (``alternatives``, a folder, stays bound).
COPIED = ("ld.so.cache", "ld.so.conf", "localtime", "mime.types")
HOST_ETC = Path("/etc")
# What says a host file changed: its kind, inode, size and modification time.
Stamp = tuple[int, int, int, int]


class SandboxEtc:
    """The folder at ``path``, kept by one backend (shared with other runners' backends
    on the same state directory). Thread-safe."""

    def __init__(self, path: Path, runner_files: dict[str, str], host_etc: Path = HOST_ETC) -> None:
        self.path = path
        self._runner_files = runner_files
        self._host_etc = host_etc
        self._lock = threading.Lock()
        self._stamps: dict[str, Stamp | None] = {}

    def write(self) -> None:
        """Make the folder (0755) with every file in it (blocking)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.path.chmod(0o755)
        for name, text in self._runner_files.items():
            target = self.path / name
            if not target.is_file() or target.read_text() != text:
                self._replace(name, functools.partial(Path.write_text, data=text))
        self.refresh()

    @property
    def copies(self) -> frozenset[str]:
        """The host files copied in (those the host has)."""
        with self._lock:
            return frozenset(name for name, stamp in self._stamps.items() if stamp is not None)

    def refresh(self) -> None:
        """Copy again each host file that changed since it was copied (blocking)."""
        for name in COPIED:
            stamp = _stamp(self._host_etc / name)
            with self._lock:
                if name in self._stamps and self._stamps[name] == stamp:
                    continue
                self._copy(name, stamp)
                self._stamps[name] = stamp

    def _copy(self, name: str, stamp: Stamp | None) -> None:
        source = self._host_etc / name
        if stamp is None:  # gone from the host, or not a file: gone here too
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
            return
        if stat.S_ISLNK(stamp[0]):
            link = source.readlink()
            self._replace(name, lambda partial: partial.symlink_to(link))
        else:
            self._replace(name, lambda partial: shutil.copyfile(source, partial, follow_symlinks=False))

    def _replace(self, name: str, make: Callable[[Path], object]) -> None:
        """Make ``name`` as a fresh partial file (``make(partial)``), then rename it into
        place."""
        partial = self.path / f".{name}.{os.getpid()}.{threading.get_ident()}"
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        make(partial)
        if not partial.is_symlink():
            partial.chmod(0o644)
        partial.replace(self.path / name)


def _stamp(path: Path) -> Stamp | None:
    """What identifies this version of a host file; None when there is no regular file or
    symlink there."""
    try:
        info = path.lstat()
    except OSError:
        return None
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        return None
    return info.st_mode, info.st_ino, info.st_size, info.st_mtime_ns
