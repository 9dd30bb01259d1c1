"""Printing a client's entries, or merging them into its own files.

A merge keeps everything else in the file (other servers, settings, and in TOML its
comments: tomlkit edits the document in place), backs the file up first, and replaces
it atomically: a temporary file in the same folder, flushed to disk, then renamed over
it, so the client never reads half a file. A file that does not parse is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from runner.config.clients import ClientConfigError, FileEdit


@dataclass(frozen=True)
class Written:
    """What a merge did to one file: ``changed`` (else it already said so) and the backup
    of the file as it was (None: it is new, or unchanged)."""

    path: Path
    changed: bool
    backup: Path | None


def render(edit: FileEdit) -> str:
    """The entry as a document of its own, to paste into ``edit.path``."""
    document: dict[str, Any] = {}
    _set(document, edit.keys, edit.value)
    if edit.kind == "toml":
        return tomlkit.dumps(document)
    return json.dumps(document, indent=2) + "\n"


def merge(edit: FileEdit) -> Written:
    """Merge ``edit`` into its file (made, with its folder, when missing).

    Raises:
        ClientConfigError: the file exists but is not a JSON object or TOML document
            (JSON with comments, say), or cannot be read or written.
    """
    path = edit.path.resolve()  # a symlinked config file keeps its link: its target is written
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError) as exc:
        raise ClientConfigError(f"cannot read {path}: {exc}") from exc
    document = _parse(edit, path, old)
    current = _get(document, edit.keys)
    if edit.at_least and _number(current) >= _number(edit.value):
        return Written(path, False, None)
    _set(document, edit.keys, edit.value)
    new = tomlkit.dumps(document) if edit.kind == "toml" else json.dumps(document, indent=2) + "\n"
    if new == old:
        return Written(path, False, None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        backup = _back_up(path) if old is not None else None
        _replace(path, new)
    except OSError as exc:
        raise ClientConfigError(f"cannot write {path}: {exc}") from exc
    return Written(path, True, backup)


def _parse(edit: FileEdit, path: Path, text: str | None) -> MutableMapping[str, Any]:
    if text is None or not text.strip():
        return tomlkit.document() if edit.kind == "toml" else {}
    if edit.kind == "toml":
        try:
            return tomlkit.parse(text)
        except TOMLKitError as exc:
            raise ClientConfigError(f"{path} is not valid TOML ({exc}); it is left as it is") from exc
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClientConfigError(
            f"{path} is not plain JSON ({exc.msg}, line {exc.lineno}: comments?); it is left as it is:"
            " add the entry by hand (runner client config without --write prints it)"
        ) from exc
    if not isinstance(document, dict):
        raise ClientConfigError(f"{path} holds no JSON object; it is left as it is")
    return document


def _get(document: MutableMapping[str, Any], keys: tuple[str, ...]) -> Any:
    node: Any = document
    for key in keys:
        if not isinstance(node, MutableMapping) or key not in node:
            return None
        node = node[key]
    return node


def _set(document: MutableMapping[str, Any], keys: tuple[str, ...], value: Any) -> None:
    node = document
    for key in keys[:-1]:
        inner = node.get(key)
        if not isinstance(inner, MutableMapping):
            # A missing section is made; one of another type (a list, say) cannot hold the entry.
            if inner is not None:
                raise ClientConfigError(f"{'.'.join(keys[:-1])} in the file is not a table/object")
            inner = tomlkit.table() if isinstance(document, tomlkit.TOMLDocument) else {}
            node[key] = inner
        node = inner
    node[keys[-1]] = value


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("-inf")


def _back_up(path: Path) -> Path:
    """A copy of ``path`` beside it, named by the time, never over an older backup."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    backup = path.with_name(f"{path.name}.{stamp}.bak")
    serial = 1
    while backup.exists():
        serial += 1
        backup = path.with_name(f"{path.name}.{stamp}-{serial}.bak")
    shutil.copy2(path, backup)
    return backup


def _replace(path: Path, text: str) -> None:
    mode = path.stat().st_mode & 0o7777 if path.exists() else None
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if mode is not None:
            Path(temporary).chmod(mode)  # the file keeps its permissions
        Path(temporary).replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            Path(temporary).unlink()
        raise
