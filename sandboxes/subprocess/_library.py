"""The tool-side helper as the sandbox user can read it.

``sandboxes.view.LIBRARY_SOURCE`` lives wherever the runner is installed, often under
``/root`` where the sandbox user has no search right, so bubblewrap (which binds as that
user) could not reach it. The backend copies it once into its state folder, readable by
all and writable only by the runner, and binds (or, degraded, points ``PYTHONPATH`` at)
that copy.
"""

from __future__ import annotations

import os
from pathlib import Path

from sandboxes.view import LIBRARY_SOURCE


def publish_library(target: Path) -> Path:
    """Copy the helper's files into ``target`` (made if need be) and return it.

    Raises:
        OSError: the state folder cannot be written.
    """
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o755)
    for source in sorted(LIBRARY_SOURCE.glob("*.py")):
        text = source.read_bytes()
        path = target / source.name
        if path.is_file() and not path.is_symlink() and path.read_bytes() == text:
            continue
        # Atomically: another runner's sandbox may be importing this very file right now.
        partial = target / f".{source.name}.{os.getpid()}"
        partial.write_bytes(text)
        partial.chmod(0o644)
        partial.replace(path)
    return target
