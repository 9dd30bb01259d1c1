"""The tool-side helper as the sandbox user can read it.

``sandboxes.view.LIBRARY_SOURCE`` lives wherever the runner is installed, often under
``/root`` where the sandbox user has no search right, so bubblewrap (which binds as that
user) could not reach it. The backend copies it once into its state folder, readable by
all and writable only by the runner, and binds (or, degraded, points ``PYTHONPATH`` at)
that copy.

Each version of the helper has a folder of its own under ``target`` (named by a hash of
its files): runners of different versions on one host share the state folder, and one
must never replace the helper another's sandboxes import.

The copy carries its bytecode: the sandbox cannot write a ``__pycache__`` into a read-only
mount, and compiling the helper on every call would cost each call milliseconds. The
bytecode is checked against the source's hash, so a stale one is never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import py_compile
from pathlib import Path

from sandboxes.view import LIBRARY_SOURCE


def publish_library(target: Path) -> Path:
    """Copy the helper's files into this version's folder under ``target`` (made if need
    be) and return that folder.

    Raises:
        OSError: the state folder cannot be written.
        py_compile.PyCompileError: the helper does not compile (a broken installation).
    """
    sources = sorted(LIBRARY_SOURCE.glob("*.py"))
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o755)
    target = target / digest.hexdigest()[:16]
    target.mkdir(exist_ok=True)
    target.chmod(0o755)
    for source in sources:
        text = source.read_bytes()
        path = target / source.name
        bytecode = Path(importlib.util.cache_from_source(str(path)))
        if path.is_file() and not path.is_symlink() and path.read_bytes() == text and bytecode.is_file():
            continue
        # Atomically: another runner's sandbox may be importing this very file right now.
        partial = target / f".{source.name}.{os.getpid()}"
        partial.write_bytes(text)
        partial.chmod(0o644)
        partial.replace(path)
        py_compile.compile(
            str(path), cfile=str(bytecode), doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
        )  # fmt: skip
        bytecode.parent.chmod(0o755)
        bytecode.chmod(0o644)
    return target
