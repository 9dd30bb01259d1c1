"""``runner init``: a starter policy, the example tools and a workspace, written into a folder.

The shipped policy names its workspace and audit log relative to itself, so it is copied
next to the tools, never used where it is installed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from runner.config.locations import POLICY_FILE, TOOLS_DIR, examples_dir

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


def write_starter(directory: Path, *, force: bool = False) -> StarterFiles:
    """Copy the starter policy and the example tools into ``directory`` and make its workspace.

    Raises:
        StarterExists: a file to write is already there and ``force`` is false (nothing written).
        OSError: the folder cannot be written.
    """
    source = examples_dir()
    files = _shipped_files(source)
    existing = [relative for relative in files if (directory / relative).exists()]
    if existing and not force:
        raise StarterExists(directory, existing)
    for relative in files:
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        shutil.copyfile(source / relative, target)
        target.chmod(0o644)
    (directory / WORKSPACE_DIR).mkdir(exist_ok=True)
    tools = sorted({relative.parts[1] for relative in files if relative.parts[0] == TOOLS_DIR})
    return StarterFiles(directory, tuple(files), tuple(tools))
