"""Where the runner's state folder is, and whether it may be used.

As root the runner writes its sandboxes' ``/etc`` files there, and makes, chowns and
removes calls' folders in it, all by path. So whoever could swap the state folder, or a
folder above it, for a link could have root write, chown or remove wherever they chose.
It is therefore resolved once, when the runner starts, through links only root or the
runner made; every folder above it must be one only root or the runner can change; it
must be the runner's own and writable by no one else. If not, nothing is written in it
and every sandbox is refused, with the reason.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from pathlib import Path

from sandboxes._owners import open_own_folder

MAX_LINKS = 40  # as the kernel's own bound on links followed in one path


def state_folder(configured: Path) -> tuple[Path, str | None]:
    """The folder ``configured`` names, resolved, and made with every missing folder above
    it (each ``0755`` whatever the umask: the sandbox's uid passes them); and why it must
    not be used, or None. Nothing is made unless the folders above it are safe."""
    folder = configured.absolute()
    try:
        folder = _resolved(folder)
        if _is_root_folder(folder):  # its etc/ is the host's /etc
            return folder, "the state folder cannot be /"
        problem = _unsafe_above(folder)
        if problem is None:
            _make_passable(folder)
            os.close(open_own_folder(folder))
    except (OSError, ValueError) as exc:
        problem = getattr(exc, "strerror", None) or str(exc)
        if isinstance(exc, OSError) and exc.filename is not None:
            problem = f"{exc.filename}: {problem}"
    return folder, problem


def _is_root_folder(folder: Path) -> bool:
    if folder == Path("/"):
        return True
    try:
        return folder.samefile("/")
    except OSError:
        return False


def _trusted() -> set[int]:
    return {0, os.geteuid()}


def _resolved(path: Path) -> Path:
    """``path`` (absolute) resolved one name at a time, as the kernel would: a link met on
    the way, in ``path`` or in a link's target, must be root's or the runner's. What is
    missing is left as named, to be made."""
    parts, current, links = list(path.parts[1:]), Path("/"), 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            current = current.parent
            continue
        step = current / name
        try:
            info = os.lstat(step)
        except FileNotFoundError:
            if ".." in parts:
                raise ValueError(f"{path}: '..' below a folder that does not exist") from None
            return current.joinpath(name, *parts)
        if not stat.S_ISLNK(info.st_mode):
            current = step
            continue
        if info.st_uid not in _trusted():
            raise PermissionError(f"{step} is a link someone other than root and the runner made")
        links += 1
        if links > MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
        target = step.readlink()
        if target.is_absolute():
            current = Path("/")
        parts = [*target.parts[target.is_absolute() :], *parts]
    return current


def _unsafe_above(folder: Path) -> str | None:
    """Why someone other than root and the runner could swap ``folder`` (resolved) or a
    folder above it, or None. Each folder above it that exists must be root's or the
    runner's, and writable by no one else, unless sticky (``/tmp``): then only the owner
    of what is in it can swap that, which must be root or the runner in turn."""
    path = [folder, *folder.parents]
    for inner, above in itertools.pairwise(path):
        try:
            info = os.lstat(above)
        except FileNotFoundError:
            continue  # to be made, by the runner
        if info.st_uid not in _trusted():
            return f"{above} is neither root's nor the runner's (owner uid {info.st_uid})"
        if not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            continue
        mode = f"mode {stat.S_IMODE(info.st_mode):04o}, group {info.st_gid}"
        if not info.st_mode & stat.S_ISVTX:
            return f"its group or others may write in {above} ({mode}): chmod go-w it, or use another folder"
        try:
            entry = os.lstat(inner)
        except FileNotFoundError:
            continue
        if entry.st_uid not in _trusted():
            return (
                f"{inner}, in {above} which others may write in ({mode}), is neither root's nor the runner's"
            )
    return None


def _make_passable(path: Path) -> None:
    """Make ``path`` and each missing folder above it, in the deepest folder that exists
    (checked by the caller), one level at a time through descriptors and set to ``0755``
    whatever the umask (a systemd unit's ``UMask=0077`` would leave them ``0700``).
    Folders that exist are left as they are: not the runner's to change.

    Raises:
        OSError: one could not be made, or someone else made one meanwhile
            (``FileExistsError``, ``ELOOP``).
    """
    missing = []
    while not os.path.lexists(path):
        missing.append(path.name)
        path = path.parent
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        for name in reversed(missing):
            os.mkdir(name, 0o755, dir_fd=fd)
            made = os.open(name, flags, dir_fd=fd)
            os.close(fd)
            fd = made
            os.fchmod(fd, 0o755)
    finally:
        os.close(fd)
