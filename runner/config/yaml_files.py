"""Reading the runner's YAML files (``tool.yaml``, ``policies.yaml``) without being stalled.

A few hundred bytes of YAML aliases ("billion laughs") describe a document of billions of
nodes, and every later walk over it (schema checks, validation) pays for all of them. So
a file is read only if it is a regular file of at most ``MAX_YAML_BYTES``, its events are
scanned before anything is built, and any alias, or nesting deeper than
``MAX_YAML_DEPTH``, refuses it. Anchors alone are harmless and allowed. A key given twice
in one mapping is refused too (YAML loaders keep the last, silently), and so is a merge
key (``<<``), whose keys the mapping's own override unseen.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import yaml

MAX_YAML_BYTES = 256 * 1024
MAX_YAML_DEPTH = 64
MERGE_TAG = "tag:yaml.org,2002:merge"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: the same result, faster


class YamlFileError(ValueError):
    """A YAML file that cannot be used; the message says why (one line)."""


def read_bounded(path: Path, max_bytes: int = MAX_YAML_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``.

    Raises:
        OSError: the file cannot be opened or read.
        YamlFileError: not a regular file, or too large.
    """
    # O_NONBLOCK: a FIFO put in a file's place must not block the runner on open.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise YamlFileError("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise YamlFileError(f"larger than {max_bytes} bytes")
    return b"".join(chunks)


def _refuse_expansion(text: str) -> None:
    """Refuse aliases, nesting past ``MAX_YAML_DEPTH``, merge keys and a key given twice in
    one mapping (the loader keeps the last: a later ``roles:`` would drop the deny rules of
    the first, unseen by anyone reading the top of the file)."""
    # Per open collection: the keys seen (None: a sequence), and whether a key comes next.
    open_: list[tuple[set[str] | None, list[bool]]] = []

    def is_key() -> bool:
        if not open_ or open_[-1][0] is None:
            return False
        next_is_key = open_[-1][1]
        next_is_key[0] = not next_is_key[0]
        return not next_is_key[0]

    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.AliasEvent):
            raise YamlFileError(f"YAML aliases (*{event.anchor}) are not allowed")
        if isinstance(event, yaml.ScalarEvent):
            keys = open_[-1][0] if is_key() else None
            if keys is not None:
                if event.value == "<<" and not event.style and event.tag in (None, MERGE_TAG):
                    raise YamlFileError(
                        "YAML merge keys (<<) are not allowed: a mapping's own keys win unseen"
                    )
                if event.value in keys:
                    mark = event.start_mark
                    where = f" (line {mark.line + 1})" if mark is not None else ""
                    raise YamlFileError(f"the key {event.value!r} is given twice in one mapping{where}")
                keys.add(event.value)
        elif isinstance(event, yaml.CollectionStartEvent):
            is_key()
            open_.append((set() if isinstance(event, yaml.MappingStartEvent) else None, [True]))
            if len(open_) > MAX_YAML_DEPTH:
                raise YamlFileError(f"nested deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            open_.pop()


def load_yaml_file(path: Path, max_bytes: int = MAX_YAML_BYTES) -> object:
    """The document in ``path``.

    Raises:
        OSError: the file cannot be opened or read.
        YamlFileError: not a regular file, too large, not UTF-8, not YAML, uses an alias,
            or nests too deep.
    """
    return parse_yaml(read_bounded(path, max_bytes), path.name)


def parse_yaml(data: bytes, name: str = "the text") -> object:
    """The document in ``data`` (read with ``read_bounded``); ``name`` (the file's) is what
    an error says it was reading.

    Raises:
        YamlFileError: not UTF-8, not YAML, uses an alias, or nests too deep.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlFileError("not UTF-8 text") from exc
    try:
        _refuse_expansion(text)
        return yaml.load(text, Loader=_LOADER)  # noqa: S506  # a safe loader, see _LOADER
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split()).replace('"<unicode string>"', name)
        raise YamlFileError(f"bad YAML: {problem}") from exc
