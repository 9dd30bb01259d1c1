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
    """Remove every folder under ``root`` whose name is ``wanted`` (never through a symlink)."""
    with contextlib.suppress(OSError):
        # Only in a folder of the runner's own: through a link, or in a folder someone else
        # may swap, these names would be someone else's.
        os.close(open_own_folder(root))
        for child in root.iterdir():
            if wanted(child.name) and not child.is_symlink():
                remove_tree(child)


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
        raise PermissionError(f"{path} is not the runner's own, or others may write in it")
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
    parent = open_own_folder(path.parent)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path.name, mode, dir_fd=parent)
        fd = open_own_folder(path, parent)
    finally:
        os.close(parent)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_passable_folders(path: Path) -> None:
    """Make the folder ``path`` and each folder above it that is missing, each passable by
    every uid whatever the umask (a systemd unit's ``UMask=0077`` would leave them
    ``0700``, and the sandbox's uid could not reach what the runner binds from them).
    Folders that exist are left as they are: not the runner's to change."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o755)
        except FileExistsError:
            continue  # someone else's, made meanwhile
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
