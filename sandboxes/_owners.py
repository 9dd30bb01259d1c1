"""Who owns what. Who left a resource behind: per-call cgroups, scratch folders and
containers are named or labelled with the pid of the runner that made them. And which
folders only the runner may change, where it makes, chowns or leases by path."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

from sandboxes._staging import remove_tree


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` alive? (One we may not signal counts as alive: not ours to judge.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(name: str) -> bool:
    """For a name ``<pid>-...``: is that runner still alive? Foreign names count as alive."""
    owner = name.split("-", 1)[0]
    return not owner.isdigit() or pid_alive(int(owner))


def remove_folders(root: Path, wanted: Callable[[str], bool]) -> None:
    """Remove every folder in ``root`` whose name is ``wanted``, listed and removed through
    descriptors, never through a link. Nothing is removed unless ``root`` and the folder
    it is in are the runner's own and writable by no one else: through a link, or in a
    folder someone else may swap, these names would be someone else's."""
    with contextlib.suppress(OSError):
        fd = _open_own_child(root)
        try:
            for name in _folder_names(fd):
                if wanted(name):
                    remove_tree(root / name, parent=fd)
        finally:
            os.close(fd)


def own_folder_names(root: Path) -> list[str]:
    """The names of the folders (not links) in ``root``, checked as ``remove_folders``
    checks it; none if it is not such a folder."""
    try:
        fd = _open_own_child(root)
    except OSError:
        return []
    try:
        return _folder_names(fd)
    finally:
        os.close(fd)


def _open_own_child(path: Path, make: int | None = None) -> int:
    """``open_own_folder`` of ``path``, through the folder it is in, itself checked the same
    way; ``make``: the mode to make ``path`` with if it is missing (the umask applies)."""
    parent = open_own_folder(path.parent)
    try:
        if make is not None:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.name, make, dir_fd=parent)
        return open_own_folder(path, parent)
    finally:
        os.close(parent)


def _folder_names(fd: int) -> list[str]:
    with os.scandir(fd) as entries:
        return [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]


def open_own_folder(path: Path, parent: int | None = None) -> int:
    """An open descriptor of the folder ``path`` (its name in the open folder ``parent``,
    if given), not followed if a link, which only the runner may change: its own, and
    writable by no one else.

    Raises:
        PermissionError: it is not the runner's own, or others may write in it.
        OSError: it cannot be opened (``ELOOP``: it is a link).
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path if parent is None else path.name, flags, dir_fd=parent)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        owner, mode = info.st_uid, stat.S_IMODE(info.st_mode)
        raise PermissionError(
            f"{path} (owner uid {owner}, mode {mode:04o}) is not the runner's own, or others may write in it"
        )
    return fd


def make_own_folder(path: Path, mode: int) -> None:
    """Make the folder ``path`` if it is missing, and give it ``mode`` whatever the umask,
    through descriptors: it and the folder it is in must be the runner's own, not links,
    and writable by no one else (``open_own_folder``). For folders the runner then makes
    things in, chowns or removes by path.

    Raises:
        OSError: either is not such a folder (``PermissionError``, ``ELOOP``), or ``path``
            cannot be made.
    """
    fd = _open_own_child(path, make=mode)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
