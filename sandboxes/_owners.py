"""Who left a resource behind: per-call cgroups, scratch folders and containers are
named or labelled with the pid of the runner that made them."""

from __future__ import annotations

import contextlib
import os
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
        for child in root.iterdir():
            if wanted(child.name) and not child.is_symlink():
                remove_tree(child)
