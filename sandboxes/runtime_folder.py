"""The user's runtime folder, where a runner without root keeps its state and listens.

Standard library only: ``runner exec`` reads it on its fast path.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def own_folder_fault(folder: Path, uid: int, *, private: bool = False) -> str | None:
    """Why ``folder`` is not a real folder of ``uid``'s own that no one else may write in
    (``private``: that no one else may even enter), or None when it is. One ``lstat``: a
    symlink is refused, never followed."""
    try:
        info = os.lstat(folder)
    except OSError as exc:
        return f"{folder}: {exc.strerror or 'cannot be read'}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a folder (a symlink, or a file)"
    if info.st_uid != uid:
        return f"{folder} belongs to uid {info.st_uid}, not to this user"
    if info.st_mode & (0o077 if private else _OTHERS_WRITE):
        wanted = "0700" if private else "writable by this user alone"
        return f"{folder} has mode {stat.S_IMODE(info.st_mode):04o}; it must be {wanted}"
    return None


def runtime_folder(uid: int, env: Mapping[str, str]) -> Path | None:
    """``$XDG_RUNTIME_DIR``, else ``/run/user/UID``: the first that is a real folder of
    ``uid``'s own that no one else may write in; None when neither is.

    A relative value is ignored, as the XDG rule says. So is one that is someone else's,
    most often root's, inherited through ``su`` without ``-``: the user could not write
    there, and its owner's folder is not the user's to use.
    """
    runtime = env.get("XDG_RUNTIME_DIR") or ""
    candidates = [Path(runtime)] if Path(runtime).is_absolute() else []
    candidates.append(Path(f"/run/user/{uid}"))
    return next((folder for folder in candidates if own_folder_fault(folder, uid) is None), None)
