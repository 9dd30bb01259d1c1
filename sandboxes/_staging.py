"""Workspace writes staged within ``disk_mb``, then applied to the workspace.

A tool granted ``workspace: write`` used to write into the host folder directly, with no
bound (2 GB written under ``disk_mb: 64``). Now, when the runner is root, the sandbox gets
an overlay instead: the workspace as its lower layer (read as it is) and, as its upper
layer, a tmpfs of ``disk_mb`` that the runner mounts for this one call. Every write lands
in that tmpfs and stops at ``disk_mb`` (ENOSPC). When the call ends the runner applies the
upper layer to the workspace (new and changed files, deletions, replaced folders) and
unmounts it.

Applying runs as root in a folder that sandboxes and local users may write, so it never
follows a symlink: every entry is reached relative to an open folder with ``O_NOFOLLOW``,
files are written under a fresh name and renamed into place (replacing, not following,
whatever stood there), and set-uid/set-gid bits are never carried over.

The overlay is made by the runner in its own mount namespace under
``/run/runner-ws/<runner pid>-<n>``; the watchdog unmounts those of a runner that died.

A runner that is not root cannot mount where it runs, but its launcher can, inside a user
namespace of its own (``UserStagedWorkspace``): the upper layer is then a folder of the
runner's on disk (a tmpfs there would die with the sandbox, before the apply), and the
apply takes at most ``disk_mb`` of it, in bytes and in entries.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MNT_DETACH = 2
_WHITEOUT_RDEV = 0
# Only the trusted namespace: the overlay is mounted by root without ``userxattr``, so a
# ``user.overlay.opaque`` is an ordinary attribute any tool may set on its own folder.
_OPAQUE_XATTR = "trusted.overlay.opaque"
# An overlay mounted in a user namespace (``userxattr``) marks with this one instead. A
# tool may set it on its own folder too, but the overlay stores the tool's attribute under
# an escaped name (``user.overlay.overlay.opaque``), so only the overlay's own mark reads
# as this one in the upper layer.
USER_OPAQUE_XATTR = "user.overlay.opaque"
# Folders deeper than this are not applied (and said so on stderr): the apply holds two
# descriptors per level.
MAX_APPLY_DEPTH = 64
# Before a removal, folders deeper than this are moved up first: ``shutil.rmtree`` holds a
# descriptor and a stack frame per level, and a tool may nest thousands.
_REMOVAL_DEPTH = 32
# tmpfs counts data pages only: empty files and folders would cost nothing against
# ``disk_mb``. This many entries per MB bounds them too.
INODES_PER_MB = 256
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SETID = stat.S_ISUID | stat.S_ISGID
COPY_CHUNK = 1024 * 1024


# Host-wide, root's own: every runner stages its calls' workspaces here.
STAGING_ROOT = Path("/run/runner-ws")


def staging_root() -> Path:
    """The staging folder, made if need be and checked to be root's own (never a symlink).

    Raises:
        StagingUnavailable: someone else owns it.
    """
    with contextlib.suppress(FileExistsError):
        STAGING_ROOT.mkdir(mode=0o700)
    info = STAGING_ROOT.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
        raise StagingUnavailable(f"{STAGING_ROOT} is not a folder of root's alone")
    return STAGING_ROOT


class StagingUnavailable(Exception):
    """The overlay could not be made; the message says why."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount(source: str, target: Path, fstype: str, options: str) -> None:
    result = _libc().mount(source.encode(), str(target).encode(), fstype.encode(), 0, options.encode())
    if result != 0:
        code = ctypes.get_errno()
        raise StagingUnavailable(f"cannot mount the workspace's {fstype}: {os.strerror(code)}")


def unmount(target: Path) -> None:
    """Detach ``target`` (lazily: a straggler holding it open cannot block us)."""
    _libc().umount2(str(target).encode(), MNT_DETACH)


class StagedWorkspace:
    """The overlay of one call: ``merged`` is what the sandbox mounts at /workspace."""

    def __init__(self, root: Path, workspace: Path, disk_mb: int) -> None:
        self.root = root
        self.workspace = workspace
        self.merged = root / "merged"
        self._disk_mb = disk_mb
        self._mounted: list[Path] = []

    def create(self, workspace_fd: int) -> None:
        """Mount the tmpfs and the overlay over the folder ``workspace_fd`` (the one that
        was checked: reached through the descriptor, never by its path again, which also
        keeps ``,`` and ``:`` of a path out of the mount options); the overlay's top folder
        takes that folder's owner and mode.

        Raises:
            StagingUnavailable: the kernel refused a mount (no overlayfs, not root).
        """
        self.root.mkdir(mode=0o700)
        try:
            inodes = max(1024, self._disk_mb * INODES_PER_MB)
            _mount("tmpfs", self.root, "tmpfs", f"size={self._disk_mb}m,nr_inodes={inodes},mode=0700")
            self._mounted.append(self.root)
            for name in ("upper", "work", "merged"):
                (self.root / name).mkdir(mode=0o755)
            upper, work = self.root / "upper", self.root / "work"
            # The overlay's top folder takes the upper layer's owner and mode: the
            # workspace's own, so the sandbox may write where it was granted to.
            like = os.fstat(workspace_fd)
            os.chown(upper, like.st_uid, like.st_gid)
            upper.chmod(stat.S_IMODE(like.st_mode))
            options = f"lowerdir=/proc/self/fd/{workspace_fd},upperdir={upper},workdir={work}"
            _mount("overlay", self.merged, "overlay", options)
            self._mounted.append(self.merged)
        except BaseException:
            self.remove()
            raise

    def apply(self, workspace_fd: int) -> None:
        """Carry the call's writes over to the workspace (the sandbox is gone by now)."""
        if self.merged in self._mounted:
            unmount(self.merged)
            self._mounted.remove(self.merged)
        upper = os.open(self.root / "upper", _OPEN_DIR)
        try:
            _apply_folder(upper, workspace_fd, _Budget(_OPAQUE_XATTR))
        finally:
            os.close(upper)

    def remove(self) -> None:
        """Unmount everything and remove the folder. Safe to call twice."""
        for target in reversed(self._mounted):
            unmount(target)
        self._mounted.clear()
        with contextlib.suppress(OSError):
            self.root.rmdir()


class UserStagedWorkspace:
    """The upper layer of one rootless call, a folder of the runner's: ``root`` holds
    ``upper`` and ``work`` (the overlay's), and ``lower`` and ``merged``, where the launcher
    binds the workspace and mounts the overlay inside its user namespace
    (``sandboxes.subprocess._launch.USER_OVERLAY_SCRIPT``)."""

    def __init__(self, root: Path, disk_mb: int) -> None:
        self.root = root
        self.merged = root / "merged"
        self._disk_mb = disk_mb
        self._made = False  # a folder that stood at ``root`` already is not ours to remove

    def create(self) -> None:
        """Raises:
        StagingUnavailable: a character of the folder's path would split the overlay's options.
        """
        if any(char in str(self.root) for char in ",:\\"):
            raise StagingUnavailable(f"its folder {self.root} has a ',', ':' or '\\' in its path")
        self.root.mkdir(mode=0o700)  # in a folder the caller made and checked
        self._made = True
        for name in ("upper", "work", "lower", "merged"):
            (self.root / name).mkdir(mode=0o700)

    def apply(self, workspace_fd: int) -> None:
        """Carry at most ``disk_mb`` of the call's writes over (the sandbox is gone by now)."""
        root = os.open(self.root, _OPEN_DIR)
        try:
            upper = _open_up(root, "upper", _OPEN_DIR, stat.S_IRWXU)  # the tool may chmod its /workspace
        finally:
            os.close(root)
        try:
            entries = max(1024, self._disk_mb * INODES_PER_MB)
            budget = _Budget(USER_OPAQUE_XATTR, self._disk_mb * 1024 * 1024, entries)
            _apply_folder(upper, workspace_fd, budget)
        finally:
            os.close(upper)

    def remove(self) -> None:
        """Remove the folder. Safe to call twice."""
        if self._made:
            remove_tree(self.root)


def remove_tree(root: Path, parent: int | None = None) -> None:
    """Remove ``root``, a folder of the runner's (an upper layer's, a tool's scratch), though
    folders in it keep the runner's user out: the overlay leaves ``work/work`` mode 000, a
    tool its folders 0555 or 000. Symlinks in it are removed, never followed. ``parent``:
    the folder it is in, opened (and checked) by the caller; else opened by its path."""
    with contextlib.suppress(OSError):
        # By descriptor, following nothing: a tool's scratch may be swapped while it is swept.
        folder = os.open(root.parent, _OPEN_DIR & ~os.O_NOFOLLOW) if parent is None else parent
        try:
            top = _open_up(folder, root.name, _OPEN_DIR, stat.S_IRWXU)
        finally:
            if parent is None:
                os.close(folder)
        try:
            _open_up_tree(top)
        finally:
            os.close(top)
    shutil.rmtree(root if parent is None else root.name, ignore_errors=True, dir_fd=parent)


def _open_up(parent: int, name: str, flags: int, needed: int) -> int:
    """``name`` in folder ``parent`` (a folder, or with ``flags`` not asking one, a regular
    file), opened with ``flags`` once its mode has the bits ``needed``. What the runner
    applies and removes is its own, but without root its own modes keep it out like anyone.
    Never follows a symlink: the bits are added to, and the folder reopened from, the inode
    opened (``O_PATH``, which needs no right on it), never a path."""
    return _opened_up(parent, name, flags, needed)[0]


def _opened_up(parent: int, name: str, flags: int, needed: int) -> tuple[int, int]:
    """``_open_up``, and the mode it had before (to be put back through the descriptor)."""
    handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        mode = os.fstat(handle).st_mode
        folder = bool(flags & os.O_DIRECTORY)
        if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
            code = errno.ELOOP if stat.S_ISLNK(mode) else errno.ENOTDIR if folder else errno.EINVAL
            raise OSError(code, os.strerror(code), name)
        if mode & needed != needed and os.geteuid() != 0:
            Path(f"/proc/self/fd/{handle}").chmod(stat.S_IMODE(mode) | needed)
        return os.open(f"/proc/self/fd/{handle}", (flags | os.O_CLOEXEC) & ~os.O_NOFOLLOW), stat.S_IMODE(mode)
    finally:
        os.close(handle)


def _open_up_tree(top: int) -> None:
    """Give every folder under ``top`` u+rwx, so that all of it can be removed; those deeper
    than ``_REMOVAL_DEPTH`` are moved up into ``top`` first."""
    moved: list[str] = []
    _open_up_folder(top, top, 0, moved)
    while moved:
        with contextlib.suppress(OSError):
            folder = os.open(moved.pop(), _OPEN_DIR, dir_fd=top)
            try:
                _open_up_folder(top, folder, 1, moved)
            finally:
                os.close(folder)


def _open_up_folder(top: int, folder: int, depth: int, moved: list[str]) -> None:
    with os.scandir(folder) as entries:  # streamed, as the apply's
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                child = _open_up(folder, entry.name, _OPEN_DIR, stat.S_IRWXU)
                try:
                    if depth + 1 < _REMOVAL_DEPTH:
                        _open_up_folder(top, child, depth + 1, moved)
                    else:
                        fresh = f".runner-deep-{secrets.token_hex(12)}"
                        os.rename(entry.name, fresh, src_dir_fd=folder, dst_dir_fd=top)
                        moved.append(fresh)
                finally:
                    os.close(child)


def remove_stale(ws_root: Path, is_stale: Callable[[str], bool]) -> None:
    """Unmount and remove the staging folders of runners that are gone."""
    with contextlib.suppress(OSError):
        for child in ws_root.iterdir():
            if is_stale(child.name):
                unmount(child / "merged")
                unmount(child)
                with contextlib.suppress(OSError):
                    child.rmdir()


def _remove_entry(parent: int, name: str) -> None:
    """Remove ``name`` in folder ``parent`` whatever it is, following nothing."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        try:
            shutil.rmtree(name, dir_fd=parent)  # fd-based, never leaves the tree by a symlink
        except PermissionError:  # a folder in it keeps a runner that is not root out
            folder, was = _opened_up(parent, name, _OPEN_DIR, stat.S_IRWXU)
            try:
                _open_up_tree(folder)
                shutil.rmtree(name, dir_fd=parent)
            except BaseException:
                _restore_mode(folder, was)
                raise
            finally:
                os.close(folder)
    else:
        os.unlink(name, dir_fd=parent)


def _is_opaque(folder: int, xattr: str) -> bool:
    try:
        return os.getxattr(folder, xattr) == b"y"
    except OSError:
        return False


def _restore_mode(fd: int, mode: int) -> None:
    """After a failure: give the folder ``fd`` back the mode it had (by descriptor)."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, mode)


def _open_or_make_folder(parent: int, name: str) -> tuple[int, int]:
    """The folder ``name`` to apply into, made if need be, which the runner may write, and
    the mode to give it back should the apply fail: its mode is the upper layer's, set once
    its entries are in (a 0555 one would refuse them)."""
    try:
        return _opened_up(parent, name, _OPEN_DIR, stat.S_IRWXU)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise
    _remove_entry(parent, name)  # a symlink or a file stood where a folder is wanted
    os.mkdir(name, 0o700, dir_fd=parent)
    return os.open(name, _OPEN_DIR, dir_fd=parent), 0o700


def _create_temporary(dest_dir: int) -> tuple[str, int]:
    """A fresh file of ours in ``dest_dir`` under an unguessable name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        temporary = f".runner-apply-{secrets.token_hex(12)}"
        try:
            return temporary, os.open(temporary, flags, 0o600, dir_fd=dest_dir)
        except FileExistsError:
            continue


def _own(target: int, info: os.stat_result) -> None:
    """Give ``target`` the owner of what the sandbox wrote. Only a change is asked for: a
    runner that is not root may not chown at all, and its writes are its own already."""
    now = os.fstat(target)
    if (now.st_uid, now.st_gid) != (info.st_uid, info.st_gid):
        os.fchown(target, info.st_uid, info.st_gid)


def _copy_file(source_dir: int, dest_dir: int, name: str, info: os.stat_result) -> None:
    source = _open_up(source_dir, name, os.O_RDONLY, stat.S_IRUSR)
    try:
        temporary, target = _create_temporary(dest_dir)
        try:
            while chunk := os.read(source, COPY_CHUNK):
                os.write(target, chunk)
            _own(target, info)
            os.fchmod(target, stat.S_IMODE(info.st_mode) & ~_SETID)
        finally:
            os.close(target)
    finally:
        os.close(source)
    try:
        os.rename(temporary, name, src_dir_fd=dest_dir, dst_dir_fd=dest_dir)
    except IsADirectoryError:
        _remove_entry(dest_dir, name)
        os.rename(temporary, name, src_dir_fd=dest_dir, dst_dir_fd=dest_dir)


@dataclass
class _Budget:
    """What an apply may still carry over (an upper layer on a tmpfs needs no bound), and
    the opaque mark it trusts."""

    opaque_xattr: str
    bytes_left: int | None = None
    entries_left: int | None = None
    exhausted: bool = False

    def take(self, size: int) -> bool:
        """Count one entry of ``size`` bytes; False (and nothing counted) past the bound."""
        if self.bytes_left is None or self.entries_left is None:
            return True
        if self.entries_left < 1 or self.bytes_left < size:
            if not self.exhausted:
                sys.stderr.write("runner: workspace writes past disk_mb were not applied\n")
            self.exhausted = True
            return False
        self.entries_left -= 1
        self.bytes_left -= size
        return True


def _apply_folder(source_dir: int, dest_dir: int, budget: _Budget, depth: int = 0) -> None:
    with os.scandir(source_dir) as names:  # streamed: a folder of millions is never listed whole
        for entry in names:
            if budget.exhausted:  # what is left costs nothing more to look at
                return
            _apply_entry(source_dir, dest_dir, entry.name, budget, depth)


def _apply_entry(source_dir: int, dest_dir: int, name: str, budget: _Budget, depth: int) -> None:
    info = os.stat(name, dir_fd=source_dir, follow_symlinks=False)
    mode = info.st_mode
    if stat.S_ISCHR(mode) and info.st_rdev == _WHITEOUT_RDEV:
        _remove_entry(dest_dir, name)  # deleted in the sandbox
    elif stat.S_ISDIR(mode) and depth >= MAX_APPLY_DEPTH:
        sys.stderr.write(f"runner: workspace writes below {MAX_APPLY_DEPTH} folders were not applied\n")
    elif not budget.take(info.st_size if stat.S_ISREG(mode) else 0):
        return
    elif stat.S_ISDIR(mode):
        source = _open_up(source_dir, name, _OPEN_DIR, stat.S_IRWXU)  # ``mode`` is as it was
        try:
            target, was = _open_or_make_folder(dest_dir, name)
            try:
                if _is_opaque(source, budget.opaque_xattr):  # replaced as a whole in the sandbox
                    for child in os.listdir(target):  # noqa: PTH208 - by descriptor
                        _remove_entry(target, child)
                _apply_folder(source, target, budget, depth + 1)
                _own(target, info)
                os.fchmod(target, stat.S_IMODE(mode) & ~stat.S_ISUID)
            except BaseException:
                _restore_mode(target, was)  # not left opened up by a failure midway
                raise
            finally:
                os.close(target)
        finally:
            os.close(source)
    elif stat.S_ISLNK(mode):
        _remove_entry(dest_dir, name)
        os.symlink(os.readlink(name, dir_fd=source_dir), name, dir_fd=dest_dir)
        os.chown(name, info.st_uid, info.st_gid, dir_fd=dest_dir, follow_symlinks=False)
    elif stat.S_ISREG(mode):
        _copy_file(source_dir, dest_dir, name, info)
    # fifos, sockets and devices are not carried over
