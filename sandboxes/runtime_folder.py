"""The user's runtime folder, where a runner without root keeps its state and listens.

Standard library only: ``runner exec`` reads it on its fast path.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


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
    for folder in candidates:
        try:
            info = os.lstat(folder)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & _OTHERS_WRITE:
            return folder
    return None
