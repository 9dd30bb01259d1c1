"""Edits of the policy file that keep it as its author wrote it, and never break it.

The file is read with ruamel.yaml's round trip, so its comments, key order and quoting stay
as they were; the edited document is loaded as a policy before it replaces the file
(atomically, same permissions), so an edit never leaves a policy the runner would refuse.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError

from runner.call.policy import Policy
from runner.errors import ConfigError


def edit_policy(policy_path: Path, change: Callable[[CommentedMap], None], what: str) -> None:
    """Apply ``change`` to the policy file's document and write it back, checked.

    Raises:
        ConfigError: the file cannot be read or written, ``change`` refused (raising
            ConfigError), or the result is not a valid policy (``what`` was not done).
    """
    source = str(policy_path)
    yaml = YAML()  # round trip: comments and layout are kept
    yaml.preserve_quotes = True
    yaml.width = 4096  # a digest is never folded onto the next line
    try:
        document = yaml.load(policy_path.read_text(encoding="utf-8"))
    except (OSError, YAMLError) as exc:
        raise ConfigError(source, f"cannot read the policy file: {exc}") from exc
    if not isinstance(document, CommentedMap):
        raise ConfigError(source, "a policy file must be a mapping")
    try:
        change(document)
    except ConfigError as exc:
        raise ConfigError(source, f"{what} {exc.problem}") from None
    text = io.StringIO()
    yaml.dump(document, text)
    _replace_checked(policy_path, text.getvalue(), what)


def merge_into(document: CommentedMap, additions: Mapping[str, Any], where: str = "") -> None:
    """Merge ``additions`` (nested as in the file) into ``document``: mappings key by key,
    lists by appending what they lack, other values set.

    Raises:
        ConfigError: the file holds something else than a mapping or a list where the
            addition needs one.
    """
    for key, value in additions.items():
        path = f"{where}.{key}" if where else key
        if isinstance(value, Mapping):
            here = document.setdefault(key, CommentedMap())
            if not isinstance(here, CommentedMap):
                raise ConfigError(path, f"{path} must be a mapping to add to it")
            merge_into(here, value, path)
        elif isinstance(value, list):
            items = document.setdefault(key, CommentedSeq())
            if not isinstance(items, CommentedSeq):
                raise ConfigError(path, f"{path} must be a list to add to it")
            items.extend(item for item in value if item not in items)
        else:
            document[key] = value


def _replace_checked(path: Path, text: str, what: str) -> None:
    """Write ``text`` beside ``path``, load it as the runner would, then put it in place."""
    try:
        mode = path.stat().st_mode & 0o7777
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".yaml")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot write beside the policy file: {exc.strerror}") from exc
    written = Path(temporary)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        try:
            Policy.load(written)
        except ConfigError as exc:
            raise ConfigError(str(path), f"{what} {exc.problem}") from None
        written.chmod(mode)
        written.replace(path)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot write the policy file: {exc.strerror}") from exc
    finally:
        written.unlink(missing_ok=True)
