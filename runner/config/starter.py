"""``runner init``: a starter policy, the example tools and a workspace, written into a folder.

The shipped policy names its workspace and audit log relative to itself, so it is copied
next to the tools, never used where it is installed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from runner.config.locations import POLICY_FILE, TOOLS_DIR, examples_dir, untrusted

WORKSPACE_DIR = "workspace"
_SKIPPED = {"__pycache__"}


@dataclass(frozen=True)
class StarterFiles:
    """What ``write_starter`` wrote (relative paths) into ``directory``."""

    directory: Path
    written: tuple[Path, ...]
    tools: tuple[str, ...]


class StarterExists(FileExistsError):
    """Files ``runner init`` would overwrite; ``existing`` lists them (relative paths)."""

    def __init__(self, directory: Path, existing: list[Path]) -> None:
        super().__init__(f"{directory}: would overwrite {', '.join(map(str, existing))}")
        self.directory = directory
        self.existing = existing


def _shipped_files(source: Path) -> list[Path]:
    files = [Path(POLICY_FILE)]
    for path in sorted((source / TOOLS_DIR).rglob("*")):
        relative = path.relative_to(source)
        if path.is_file() and not _SKIPPED & set(relative.parts) and path.suffix != ".pyc":
            files.append(relative)
    return files


def _check_folders(directory: Path, relative: Path) -> None:
    """Raises ``PermissionError`` when a folder between ``directory`` and ``relative`` is
    another user's, open to every user, or another user's symbolic link: ``runner init`` as
    root in a folder others can write to (a sticky ``/tmp``) would write where they chose."""
    folder = directory
    for part in relative.parts:
        folder = folder / part
        if folder.is_symlink() and folder.lstat().st_uid not in (0, os.getuid()):
            raise PermissionError(
                errno.EPERM, f"{folder} is another user's symbolic link: runner init writes nothing there"
            )
        if why := untrusted(folder):
            raise PermissionError(errno.EPERM, f"{why}: runner init writes nothing there")


def _make_folders(directory: Path, relative: Path) -> None:
    """The folders of ``relative`` under ``directory``, each one made ``0755`` whatever the
    umask: the sandbox's user reads the tools (and dispatch ships only what all may read)."""
    folder = directory
    for part in relative.parts:
        folder /= part
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
            folder.chmod(0o755)


def write_starter(directory: Path, *, force: bool = False) -> StarterFiles:
    """Copy the starter policy and the example tools into ``directory`` and make its workspace.

    Raises:
        StarterExists: a file to write is already there and ``force`` is false (nothing written).
        OSError: the folder cannot be written, or is not to be written (it or a folder in
            it another user's or open to every user, or another user's symbolic link).
    """
    source = examples_dir()
    files = _shipped_files(source)
    if why := untrusted(directory):
        raise PermissionError(errno.EPERM, f"{why}: runner init writes nothing there")
    for relative in sorted({*(path.parent for path in files), Path(WORKSPACE_DIR)}):  # before writing
        _check_folders(directory, relative)
    existing = [relative for relative in files if (directory / relative).exists()]
    if existing and not force:
        raise StarterExists(directory, existing)
    for relative in files:
        target = directory / relative
        _make_folders(directory, relative.parent)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        # A new file, never through a link (one planted between the unlink and here fails).
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write((source / relative).read_bytes())
            os.fchmod(out.fileno(), 0o644)
    (directory / WORKSPACE_DIR).mkdir(exist_ok=True)
    tools = sorted({relative.parts[1] for relative in files if relative.parts[0] == TOOLS_DIR})
    return StarterFiles(directory, tuple(files), tuple(tools))
