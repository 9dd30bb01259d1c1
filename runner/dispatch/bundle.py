"""A tool folder on its way to a node: packed with its content hash, unpacked and checked.

The caller packs the folder it registered (a tar, symlinks kept as links, never followed)
and hashes the very bytes it packs; the node unpacks into a private cache keyed by that
hash, recomputes the hash of what is on its disk and runs the tool only when both agree.
So a node never runs a stale copy (another hash is another folder) or an altered one (the
recomputed hash differs), and an archive cannot write outside its folder: Python's
``data`` extraction filter refuses absolute paths, ``..``, links leading out of the folder
and device files, and drops set-uid bits.

The hash covers each entry's relative path, its type, its execute bit and its content (a
link: its target); not owners or times, which the unpacking cannot keep.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import stat
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from sandboxes import SandboxUnavailable

# A cache entry not used for this long may be removed by the next unpacking on the node.
CACHE_KEEP_S = 24 * 3600


class BundleTooLarge(SandboxUnavailable):
    """The tool folder is larger than ``dispatch.max_bundle_bytes``."""


@dataclass(frozen=True)
class ToolBundle:
    """A packed tool folder: the tar's bytes and the content hash of what they hold."""

    data: bytes
    sha256: str


class _TreeHash:
    """The content hash of a folder, fed entry by entry in path order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, relative: str, kind: str, executable: bool, content: bytes) -> None:
        digest = hashlib.sha256(content).hexdigest()
        line = f"{kind}\0{int(executable)}\0{relative}\0{digest}\n"
        self._hash.update(line.encode("utf-8", errors="surrogateescape"))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _entries(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every entry under ``root`` (not ``root`` itself) by relative path, sorted, no link followed."""
    found: list[tuple[str, os.stat_result]] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in (*dirs, *files):
            path = os.path.join(folder, name)  # noqa: PTH118 - os.walk's own strings
            found.append((os.path.relpath(path, root), os.lstat(path)))
    return sorted(found)


def pack(folder: Path, max_bytes: int) -> ToolBundle:
    """``folder`` as a tar and the content hash of the same bytes (blocking: a thread's work).

    Raises:
        BundleTooLarge: the folder's files add up to more than ``max_bytes``.
        SandboxUnavailable: the folder cannot be read, or holds what cannot be shipped
            (a device, a socket, a fifo).
    """
    tree, out, total = _TreeHash(), io.BytesIO(), 0
    try:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for relative, st in _entries(folder):
                path = folder / relative
                info = tarfile.TarInfo(relative)
                info.mode = 0o755 if _executable(st) else 0o644
                info.mtime = 0
                if stat.S_ISLNK(st.st_mode):
                    target = str(path.readlink())
                    info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                    tree.add(relative, "link", False, target.encode("utf-8", errors="surrogateescape"))
                    tar.addfile(info)
                elif stat.S_ISDIR(st.st_mode):
                    info.type = tarfile.DIRTYPE
                    tree.add(relative, "dir", _executable(st), b"")
                    tar.addfile(info)
                elif stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    if total > max_bytes:
                        raise BundleTooLarge(
                            f"the tool folder is larger than dispatch.max_bundle_bytes ({max_bytes} bytes)"
                        )
                    content = _read_regular(path)
                    info.size = len(content)
                    tree.add(relative, "file", _executable(st), content)
                    tar.addfile(info, io.BytesIO(content))
                else:
                    raise SandboxUnavailable(f"the tool folder holds {relative!r}, which is not a file")
    except OSError as exc:
        raise SandboxUnavailable(f"the tool folder cannot be read: {exc.strerror}") from exc
    return ToolBundle(out.getvalue(), tree.hexdigest())


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes, opened without following a link (swapped in since the walk)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def _executable(st: os.stat_result) -> bool:
    return bool(st.st_mode & stat.S_IXUSR)


def tree_hash(root: Path) -> str:
    """The content hash of the folder ``root`` as it is on disk (what ``pack`` computes).

    Raises:
        SandboxUnavailable: an entry cannot be read or is not a file, folder or link.
    """
    tree = _TreeHash()
    try:
        for relative, st in _entries(root):
            path = root / relative
            if stat.S_ISLNK(st.st_mode):
                target = str(path.readlink()).encode("utf-8", errors="surrogateescape")
                tree.add(relative, "link", False, target)
            elif stat.S_ISDIR(st.st_mode):
                tree.add(relative, "dir", _executable(st), b"")
            elif stat.S_ISREG(st.st_mode):
                tree.add(relative, "file", _executable(st), _read_regular(path))
            else:
                raise SandboxUnavailable(f"the unpacked tool folder holds {relative!r}, which is not a file")
    except OSError as exc:
        raise SandboxUnavailable(f"the unpacked tool folder cannot be read: {exc.strerror}") from exc
    return tree.hexdigest()


def private_cache(root: Path) -> Path:
    """``root``, made if missing: a real folder (not a link), this user's, mode 0700.

    Raises:
        SandboxUnavailable: it exists but is a link, someone else's, or open to others.
    """
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(root)
    except OSError as exc:
        raise SandboxUnavailable(f"the node's tool cache cannot be made: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxUnavailable(
            "the node's tool cache is not a private folder (it must be a folder of the node's "
            "runner user, mode 0700)"
        )
    return root


def unpack(bundle: ToolBundle, cache_root: Path) -> Path:
    """The folder holding ``bundle`` under ``cache_root`` (unpacked now, or earlier by the
    same hash), its content hash checked against the bundle's.

    Raises:
        SandboxUnavailable: the archive holds what may not be unpacked, or what is on disk
            does not hash to ``bundle.sha256`` (an altered archive or cache entry).
    """
    root = private_cache(cache_root)
    if len(bundle.sha256) != 64 or any(c not in "0123456789abcdef" for c in bundle.sha256):
        raise SandboxUnavailable("the tool bundle's hash is not a sha256 digest")
    final = root / bundle.sha256
    if final.is_dir() and not final.is_symlink():
        if tree_hash(final) == bundle.sha256:
            os.utime(final)
            return final
        shutil.rmtree(final, ignore_errors=True)  # altered since: unpacked again below
    staging = root / f".unpacking-{secrets.token_hex(8)}"
    try:
        staging.mkdir(mode=0o700)
        try:
            with tarfile.open(fileobj=io.BytesIO(bundle.data), mode="r:") as tar:
                tar.extractall(staging, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise SandboxUnavailable(f"the tool bundle cannot be unpacked: {exc}") from exc
        found = tree_hash(staging)
        if found != bundle.sha256:
            raise SandboxUnavailable(
                "the tool folder unpacked on the node does not match the caller's content hash"
            )
        staging.chmod(0o755)  # the folder itself, as a tool folder is: readable
        try:
            staging.rename(final)
        except OSError as exc:  # another task unpacked the same hash first: theirs is as good
            if not final.is_dir() or tree_hash(final) != bundle.sha256:
                raise SandboxUnavailable(f"the tool folder cannot be cached: {exc.strerror}") from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _evict_stale(root, keep=final)
    return final


def _evict_stale(root: Path, keep: Path) -> None:
    """Remove the cache entries no task used for ``CACHE_KEEP_S`` (each use touches its entry)."""
    cutoff = time.time() - CACHE_KEEP_S
    for entry in root.iterdir():
        try:
            if entry != keep and entry.lstat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue
