"""The workspace folder, handled by a root runner without trusting its path.

The policy names the workspace by path, and a local user may own some folder on that
path. Were the runner to follow a symlink there, it would hand a folder of its choosing
(``/root``, ``/etc``) to the sandbox, writable. So, as root:

- every component of the path is opened without following symlinks, and must be owned
  by root (or the runner's user) and writable by no one else unless sticky (like
  ``/tmp``, where nobody else can rename what root owns): then nobody else can swap any
  part of it between this check and the sandbox's bind mount;
- the folder itself must be owned by the runner's user;
- ownership and modes are changed through the opened descriptor, never by path;
- after a call that could write, no set-uid or set-gid file is left in it (the sweep
  opens every entry without following symlinks).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from sandboxes._identity import SANDBOX_GID
from sandboxes._staging import StagedWorkspace, StagingUnavailable, UserStagedWorkspace, staging_root
from sandboxes.base import LaunchSpec, SandboxUnavailable, WorkspaceNotApplied

_TRUSTED_OWNERS = frozenset({0, os.geteuid()})
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WorkspaceRefused(Exception):
    """The workspace path cannot be trusted; the message says why and what to do."""


def _check_component(fd: int, shown: str, final: bool) -> None:
    info = os.fstat(fd)
    if final:
        if info.st_uid != os.geteuid():
            raise WorkspaceRefused(
                f"workspace {shown} is owned by uid {info.st_uid}, not by the runner's user: "
                "chown it to the runner's user or choose another folder"
            )
        return
    if info.st_uid not in _TRUSTED_OWNERS:
        raise WorkspaceRefused(f"workspace path component {shown} is owned by uid {info.st_uid}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise WorkspaceRefused(f"workspace path component {shown} is writable by others")


def open_workspace(path: Path, create: bool) -> int:
    """A descriptor of the workspace folder, reached without following any symlink.

    Raises:
        WorkspaceRefused: a component is a symlink, not a folder, or not trustworthy.
    """
    if not path.is_absolute():
        raise WorkspaceRefused(f"workspace {path} is not an absolute path")
    parts = [p for p in path.parts[1:] if p not in ("", ".")]
    if ".." in parts:
        raise WorkspaceRefused(f"workspace {path} contains '..'")
    fd = os.open("/", _OPEN_DIR)
    shown = "/"
    try:
        for index, part in enumerate(parts):
            _check_component(fd, shown, final=False)
            final = index == len(parts) - 1
            if final and create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            shown = str(Path(shown) / part)
            try:
                child = os.open(part, _OPEN_DIR, dir_fd=fd)
            except OSError as exc:
                raise WorkspaceRefused(
                    f"workspace {shown} is a symlink or not a folder ({exc.strerror}); "
                    "name the real folder in the policy"
                ) from exc
            os.close(fd)
            fd = child
        _check_component(fd, shown, final=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def grant_group_write(fd: int) -> None:
    """Let every sandbox (one group, distinct uids) write the folder; new entries inherit
    the group (set-gid folder)."""
    info = os.fstat(fd)
    if info.st_gid != SANDBOX_GID:
        os.fchown(fd, -1, SANDBOX_GID)
    wanted = stat.S_IMODE(info.st_mode) | stat.S_IRWXG | stat.S_ISGID
    if stat.S_IMODE(info.st_mode) != wanted:
        os.fchmod(fd, wanted)


def strip_setid_files(fd: int) -> int:
    """Clear set-uid and set-gid bits of every regular file under the folder ``fd``.

    Returns how many files were changed. Symlinks are never followed; each file is opened
    with ``O_NOFOLLOW`` and changed through its descriptor, so a tool racing to swap an
    entry for a symlink changes nothing outside.
    """
    changed = 0
    start = os.dup(fd)
    try:
        for _, _, files, dir_fd in os.fwalk(".", dir_fd=start, follow_symlinks=False):
            for name in files:
                with contextlib.suppress(OSError):
                    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if not stat.S_ISREG(info.st_mode) or not info.st_mode & (stat.S_ISUID | stat.S_ISGID):
                        continue
                    file_fd = os.open(
                        name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
                    )
                    try:
                        mode = stat.S_IMODE(os.fstat(file_fd).st_mode)
                        os.fchmod(file_fd, mode & ~(stat.S_ISUID | stat.S_ISGID))
                        changed += 1
                    finally:
                        os.close(file_fd)
    finally:
        os.close(start)
    return changed


class GrantedWorkspace:
    """The workspace of one call: where the sandbox mounts it from, and what to do after.

    A ``write`` grant is staged (``sandboxes._staging``): as root the sandbox mounts an
    overlay whose writes stop at ``disk_mb``; without root, given ``user_stage``, the
    launcher mounts one in its user namespace over a folder of the runner's (``user_stage``
    is then set, and ``source`` is the workspace itself). Either way the writes are applied
    when the call ends.
    """

    def __init__(
        self,
        fd: int,
        mode: str,
        source: Path,
        staged: StagedWorkspace | None,
        user_stage: UserStagedWorkspace | None = None,
    ) -> None:
        self.fd = fd
        self.mode = mode
        self.source = source  # what the sandbox binds at /workspace (or the launcher stages)
        self._staged = staged
        self.user_stage = user_stage

    @classmethod
    def open(
        cls, spec: LaunchSpec, disk_mb: int, name: str, user_stage: Path | None = None
    ) -> GrantedWorkspace | None:
        """None when no workspace is granted. ``user_stage``: without root, the folder
        where the launcher is to stage a ``write`` grant (else the grant is bound directly).

        Raises:
            SandboxUnavailable: the workspace path cannot be trusted or staged.
        """
        if spec.workspace is None or spec.workspace_mode == "none":
            return None
        if os.geteuid() != 0:
            # Nothing to misuse: an unprivileged runner can only reach what its user can.
            spec.workspace.mkdir(parents=True, exist_ok=True)
            fd = os.open(spec.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if spec.workspace_mode != "write" or user_stage is None:
                return cls(fd, spec.workspace_mode, spec.workspace, None)
            stage = UserStagedWorkspace(user_stage, disk_mb)
            try:
                stage.create()
            except (OSError, StagingUnavailable) as exc:
                os.close(fd)
                stage.remove()
                raise SandboxUnavailable(f"cannot stage the workspace: {exc}") from exc
            return cls(fd, spec.workspace_mode, spec.workspace, None, stage)
        try:
            fd = open_workspace(spec.workspace, create=True)
        except WorkspaceRefused as exc:
            raise SandboxUnavailable(str(exc)) from exc
        if spec.workspace_mode != "write":
            return cls(fd, spec.workspace_mode, spec.workspace, None)
        try:
            grant_group_write(fd)
            staged = StagedWorkspace(staging_root() / name, spec.workspace, disk_mb)
            staged.create(fd)
        except (OSError, StagingUnavailable) as exc:
            os.close(fd)
            raise SandboxUnavailable(f"cannot stage the workspace: {exc}") from exc
        return cls(fd, spec.workspace_mode, staged.merged, staged)

    def release(self) -> None:
        """After the sandbox is gone: apply staged writes, or clear set-id files left by
        direct ones; then let go of everything. Safe to call twice.

        Raises:
            WorkspaceNotApplied: the staged writes could not all be applied (all is let go).
        """
        if self.fd < 0:
            return
        try:
            stage = self._staged or self.user_stage
            if stage is not None:
                try:
                    stage.apply(self.fd)
                except OSError as exc:
                    message = f"the workspace writes could not all be applied: {exc.strerror or exc}"
                    raise WorkspaceNotApplied(message) from exc
                finally:
                    stage.remove()
            elif self.mode == "write":
                # Nothing the tool made may run as its uid (or group) for a local user.
                strip_setid_files(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
