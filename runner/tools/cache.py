"""Manifests already found valid, by the SHA-256 of their bytes: each schema is checked once.

Checking a schema against the Draft 2020-12 metaschema takes milliseconds (jsonschema
resolves the metaschema's dynamic references as it goes), and parsing YAML a fraction of
one; three hundred tools cost seconds at every start. So a manifest that passed every
check of ``runner.tools.manifest.load_tool`` is kept here as its JSON document, under the digest
of its file: the same bytes give the same document and the same verdict, and a changed
file is a new digest. The pydantic model is still built from every document (it is
cheap), so only the YAML and schema checks are skipped.

The file lives in ``$XDG_CACHE_HOME/runner/`` (default ``~/.cache/runner/``). It is a trust
store, so it is used only when it belongs to this user and no one else may write it; the
checks it records depend on the code doing them, so it is keyed by the files of that code
(jsonschema, RE2 and the runner's own checks), and a different key empties it. Any
problem with it (missing, unreadable, corrupt, foreign) only means checking from scratch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import stat
from pathlib import Path
from typing import Any

CACHE_FILE = "manifests.json"
MAX_ENTRIES = 4096  # kept across tool folders; the oldest go first
_MAX_FILE_BYTES = 64 * 1024 * 1024
# Bump when a check changes in a way the code key below cannot see.
_FORMAT = 1
# The modules whose code decides what the cache records.
_CHECKERS = (
    "jsonschema",
    "jsonschema_specifications",
    "re2",
    "yaml",
    "runner.config.yaml_files",
    "runner.schema.compiled",
    "runner.schema.keywords",
    "runner.schema.patterns",
)


def cache_dir(env: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/runner`` (a relative value is ignored, as the XDG rule says)."""
    base = env.get("XDG_CACHE_HOME") or ""
    return (Path(base) if Path(base).is_absolute() else Path.home() / ".cache") / "runner"


def digest(data: bytes) -> str:
    """The key of a manifest's bytes."""
    return hashlib.sha256(data).hexdigest()


def _code_key() -> str:
    parts = [str(_FORMAT)]
    for name in _CHECKERS:
        spec = importlib.util.find_spec(name)  # finds, never imports, the module
        origin = spec.origin if spec is not None else None
        try:
            info = Path(origin).stat() if origin else None
        except OSError:
            info = None
        parts.append(f"{name}={origin}:{info.st_size}:{info.st_mtime_ns}" if info else f"{name}=-")
    return digest("\n".join(parts).encode())


def _round_trips(document: object) -> bool:
    # Only plain JSON comes back the same from the file (no dates, sets or int keys).
    try:
        return bool(json.loads(json.dumps(document, allow_nan=False)) == document)
    except (TypeError, ValueError, RecursionError):
        return False


class ManifestCache:
    """Documents of manifests found valid, by ``digest``; ``save`` writes the new ones."""

    def __init__(self, path: Path | None, entries: dict[str, Any], key: str) -> None:
        self.path = path
        self._entries = entries
        self.key = key
        self._changed = False

    @classmethod
    def open(cls, directory: Path | None = None) -> ManifestCache:
        """The cache in ``directory`` (default ``cache_dir()``); empty when it cannot be used."""
        key = _code_key()
        folder = directory or cache_dir()
        if directory is None and not _own_way(folder):
            return cls.disabled()
        path = folder / CACHE_FILE
        return cls(path, _read_entries(path, key), key)

    @classmethod
    def disabled(cls) -> ManifestCache:
        """A cache that never holds anything: every manifest is checked."""
        return cls(None, {}, "")

    def get(self, key: str) -> Any | None:
        """The document stored under ``key``, or None."""
        return self._entries.get(key) if self.path is not None else None

    def put(self, key: str, document: object) -> None:
        """Record that the manifest with digest ``key`` and this document passed every check."""
        if self.path is None or key in self._entries or not _round_trips(document):
            return
        self._entries[key] = document
        self._changed = True

    def remember(self, key: str, document: object) -> None:
        """Store ``document`` under ``key``, replacing what was there (a listing's failure,
        which may change, unlike what passed the checks)."""
        if self.path is None or not _round_trips(document):
            return
        self._entries[key] = document
        self._changed = True

    def save(self) -> None:
        """Write the file when something was added; a failure to write is not an error."""
        if self.path is None or not self._changed:
            return
        entries = dict(list(self._entries.items())[-MAX_ENTRIES:])
        body = json.dumps({"key": self.key, "entries": entries}, separators=(",", ":")).encode()
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write_in_own_folder(self.path, body)
        self._changed = False


def _own_way(folder: Path) -> bool:
    """Whether the nearest folder of ``folder``'s way that exists (it, or the one it would
    be made in) is this user's: root with another user's ``$HOME`` (``su`` without ``-``)
    would otherwise make and write its cache where that user's links lead."""
    while True:
        try:
            return folder.lstat().st_uid == os.geteuid()
        except FileNotFoundError:
            if folder == folder.parent:
                return False
            folder = folder.parent
        except OSError:
            return False


def _write_in_own_folder(path: Path, body: bytes) -> None:
    """Write ``path`` whole (a new file renamed over it: a runner starting meanwhile reads
    the old file or the new one), through a descriptor of its folder opened without
    following a link, and only if that folder is this user's and no one else may write it:
    as root, with ``$HOME`` a user's (``su`` without ``-``), a planted link there would
    have root replace a file of the link's choosing.

    Raises:
        OSError: it cannot be written, or the folder is not to be used.
    """
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(folder)
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(f"{path.parent} is not this user's own folder")
        temporary = f".manifests-{os.urandom(8).hex()}"
        fd = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=folder,
        )
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(body)
            os.rename(temporary, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=folder)
            raise
    finally:
        os.close(folder)


def _read_entries(path: Path, key: str) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        info = os.fstat(fd)
        # Another user's file, or one others may write, could vouch for an unchecked schema.
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.geteuid()
            or info.st_mode & 0o022
            or info.st_size > _MAX_FILE_BYTES
        ):
            return {}
        with os.fdopen(os.dup(fd), "rb") as stream:
            stored = json.loads(stream.read())
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(fd)
    entries = stored.get("entries") if isinstance(stored, dict) and stored.get("key") == key else None
    return entries if isinstance(entries, dict) else {}
