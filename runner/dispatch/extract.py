"""A tool bundle's tar written out on the node: the same code on every supported Python.

Python's own extraction filters (``filter="data"``) arrived in 3.11.4, and Debian 12 ships
3.11.2; their later fixes differ from patch release to patch release. So the runner never
lets ``tarfile`` write anything: it reads the members, checks the archive as a whole, then
writes each entry itself, the same way on every version.

Refused before anything is written: a name that is absolute, empty, or holds ``.`` or
``..`` (``a/../b`` too); the same name twice; an entry whose folder is not a folder earlier
in the archive; anything but a regular file, a folder or a symbolic link (hard links,
devices, fifos, sparse and continuation entries); set-uid, set-gid and sticky bits; and a
link whose target leaves the folder, resolved through the archive's own links as the
kernel would (an absolute target, ``..`` past the top, a chain of links that ends outside,
a loop). The archive's tree is all there is in the fresh staging folder, so this check is
the kernel's resolution on disk.

Written through directory descriptors: every folder opened without following a link, every
file created new (``O_EXCL``) with mode 0644, or 0755 when its owner may execute it, every
folder 0755; owners and times are not taken from the archive.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass
from typing import IO

from sandboxes import SandboxUnavailable

_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)
_NAMED_TYPES = {
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}
# Resolving one link target may take this many steps (components) and follow this many
# links (the kernel's own bound): a tool folder's links are short; a loop, or a chain
# built to cost time, is refused.
MAX_RESOLVE_STEPS = 4096
MAX_LINKS_FOLLOWED = 40
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


class UnsafeBundle(SandboxUnavailable):
    """The archive holds an entry that may not be unpacked (see the module)."""


@dataclass(frozen=True)
class _Member:
    info: tarfile.TarInfo
    parts: tuple[str, ...]
    kind: str  # "file", "dir" or "link"


def extract(tar: tarfile.TarFile, staging: str, max_entries: int, max_path_bytes: int) -> None:
    """Write the checked entries of ``tar`` into the empty folder ``staging``.

    Raises:
        UnsafeBundle: an entry may not be unpacked; nothing was written.
        tarfile.TarError, OSError: the archive is malformed or cannot be written.
    """
    members = checked_members(tar, max_entries, max_path_bytes)
    root = os.open(staging, _DIR_FLAGS)
    try:
        for member in members:
            _write(tar, member, root)
    finally:
        os.close(root)


def checked_members(tar: tarfile.TarFile, max_entries: int, max_path_bytes: int) -> list[_Member]:
    """Every member of ``tar``, in order, once each has passed the checks of the module.

    Raises:
        UnsafeBundle: the first entry that fails them.
        tarfile.TarError: the archive is malformed.
    """
    members: list[_Member] = []
    kinds: dict[str, str] = {}
    links: dict[tuple[str, ...], str] = {}
    for info in tar:
        if len(members) >= max_entries:
            raise UnsafeBundle(f"the tool bundle holds more than {max_entries} entries")
        member = _checked(info, kinds, max_path_bytes)
        kinds[info.name] = member.kind
        if member.kind == "link":
            links[member.parts] = info.linkname
        members.append(member)
    for member in members:
        if member.kind == "link" and _resolve(member.parts[:-1], member.info.linkname, links) is None:
            target = member.info.linkname
            raise _refused(member.info.name, f"is a link leading out of the tool folder ({target!r})")
    return members


def _checked(info: tarfile.TarInfo, kinds: dict[str, str], max_path_bytes: int) -> _Member:
    name = info.name
    parts = tuple(name.split("/"))
    if not name or name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise _refused(name, "is not a relative path inside the tool folder")
    if len(_encoded(name)) > max_path_bytes or len(_encoded(info.linkname)) > max_path_bytes:
        raise _refused(name[:80], f"has a name or link target longer than {max_path_bytes} bytes")
    if name in kinds:
        raise _refused(name, "appears twice")
    folder = "/".join(parts[:-1])
    if folder and kinds.get(folder) != "dir":
        raise _refused(name, "is not inside a folder the archive made before it")
    if info.type in _FILE_TYPES:
        kind = "file"
    elif info.type == tarfile.DIRTYPE:
        kind = "dir"
    elif info.type == tarfile.SYMTYPE:
        kind = "link"
    else:
        what = _NAMED_TYPES.get(info.type, f"an entry of type {info.type!r}")
        raise _refused(name, f"is {what}, not a file, folder or link")
    if info.mode & 0o7000:
        raise _refused(name, "has a set-uid, set-gid or sticky bit")
    return _Member(info, parts, kind)


def _resolve(folder: tuple[str, ...], target: str, links: dict[tuple[str, ...], str]) -> list[str] | None:
    """Where ``target``, a link's target in ``folder``, leads in the archive's tree: its
    components from the top, or None when it leaves the tree (or takes too many steps)."""
    steps = followed_links = 0

    def walk(start: list[str], text: str) -> list[str] | None:
        nonlocal steps, followed_links
        if not text or text.startswith("/"):
            return None
        path = list(start)
        for part in text.split("/"):
            steps += 1
            if steps > MAX_RESOLVE_STEPS:
                return None
            if part in ("", "."):
                continue
            if part == "..":
                if not path:
                    return None
                path.pop()
                continue
            linked = links.get((*path, part))
            if linked is None:
                path.append(part)
                continue
            followed_links += 1
            if followed_links > MAX_LINKS_FOLLOWED:
                return None
            followed = walk(path, linked)  # a link resolves from the folder that holds it
            if followed is None:
                return None
            path = followed
        return path

    return walk(list(folder), target)


def _write(tar: tarfile.TarFile, member: _Member, root: int) -> None:
    parent = _open_folder(root, member.parts[:-1])
    name = member.parts[-1]
    try:
        if member.kind == "dir":
            os.mkdir(name, 0o700, dir_fd=parent)
            made = os.open(name, _DIR_FLAGS, dir_fd=parent)
            try:
                os.fchmod(made, 0o755)
            finally:
                os.close(made)
        elif member.kind == "link":
            os.symlink(member.info.linkname, name, dir_fd=parent)
        else:
            content = tar.extractfile(member.info)
            if content is None:
                raise _refused(member.info.name, "has no content")
            made = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent)
            try:
                _copy(content, made)
                os.fchmod(made, 0o755 if member.info.mode & 0o100 else 0o644)
            finally:
                os.close(made)
    finally:
        if parent != root:
            os.close(parent)


def _open_folder(root: int, parts: tuple[str, ...]) -> int:
    """The folder ``parts`` under ``root``, each step opened without following a link."""
    fd = root
    for part in parts:
        child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        if fd != root:
            os.close(fd)
        fd = child
    return fd


def _copy(source: IO[bytes], fd: int) -> None:
    while chunk := source.read(_CHUNK):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


def _refused(name: str, why: str) -> UnsafeBundle:
    return UnsafeBundle(f"the tool bundle's entry {name!r} {why}")


def _encoded(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")
