"""A tool folder on its way to a node: packed with its content hash, unpacked and checked.

The caller packs the folder it registered (a tar, symlinks kept as links, never followed)
and hashes the very bytes it packs; the node unpacks into a private cache keyed by that
hash, recomputes the hash of what is on its disk and runs the tool only when both agree.
So a node never runs a stale copy (another hash is another folder) or an altered one (the
recomputed hash differs), and an archive cannot write outside its folder: the runner's own
extraction (``extract``, the same on every Python it supports) refuses absolute paths,
``..``, links leading out of the folder, hard links, devices, fifos and set-id bits.

The folder is read through directory descriptors, each entry opened relative to its
folder without following a link and checked to be the entry the listing saw: a folder
swapped for a link while it is packed cannot make the packing read outside it. The archive
is bounded as it is written (``max_bundle_bytes``), and so are its entries and their names.

The hash covers each entry's relative path, its type, its execute bit and its content (a
link: its target); not owners or times, which the unpacking cannot keep.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import secrets
import shutil
import stat
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.dispatch.extract import extract
from sandboxes import SandboxUnavailable

# A cache entry not used for this long may be removed by the next unpacking on the node.
CACHE_KEEP_S = 24 * 3600


class BundleTooLarge(SandboxUnavailable):
    """The tool folder is larger than ``dispatch.max_bundle_bytes``, or holds more entries,
    or longer names or link targets, than a tool folder may."""


# A tool folder is a handful of files: more entries, or longer paths or link targets, are
# refused before they cost the node time (each entry is hashed again on every cache hit).
MAX_ENTRIES = 10_000
MAX_PATH_BYTES = 1024
# Opening an entry in the folder: never through a link, never blocking (a fifo swapped in).
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True)
class ToolBundle:
    """A packed tool folder: the tar's bytes and the content hash of what they hold."""

    data: bytes
    sha256: str


@dataclass(frozen=True)
class _Entry:
    """One entry of a folder as read: a file's bytes, a link's target, a folder's nothing."""

    relative: str
    kind: str  # "file", "dir" or "link"
    executable: bool
    content: bytes


class _TreeHash:
    """The content hash of a folder, fed entry by entry in path order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, entry: _Entry) -> None:
        digest = hashlib.sha256(entry.content).hexdigest()
        line = f"{entry.kind}\0{int(entry.executable)}\0{entry.relative}\0{digest}\n"
        self._hash.update(_encoded(line))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _Budget:
    """What reading a folder may still take: bytes of content, entries, path lengths."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.content_left = max_bytes
        self.entries = 0

    def admit(self, relative: str) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise BundleTooLarge(f"the tool folder holds more than {MAX_ENTRIES} entries")
        if len(_encoded(relative)) > MAX_PATH_BYTES:
            raise BundleTooLarge(f"the tool folder holds a path longer than {MAX_PATH_BYTES} bytes")

    def too_large(self) -> BundleTooLarge:
        return BundleTooLarge(
            f"the tool folder is larger than dispatch.max_bundle_bytes ({self.max_bytes} bytes)"
        )


def _read_tree(root: Path, budget: _Budget) -> list[_Entry]:
    """Every entry under ``root`` (not ``root`` itself), sorted by relative path.

    Read through directory descriptors, never by path: each folder and file is opened
    relative to its parent's descriptor without following a link, and checked to be the
    entry the listing saw (device and inode). So swapping a folder for a link while this
    runs (``renameat2`` with ``RENAME_EXCHANGE``) cannot make it read outside ``root``: the
    swapped entry fails to open or fails the check.

    Raises:
        OSError: an entry cannot be read, or changed while it was read (``ESTALE``).
        BundleTooLarge: past ``budget``.
        SandboxUnavailable: an entry is not a file, folder or link.
    """
    found: list[_Entry] = []
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _read_folder(root_fd, "", budget, found)
    finally:
        os.close(root_fd)
    return sorted(found, key=lambda entry: entry.relative)


def _read_folder(dir_fd: int, prefix: str, budget: _Budget, found: list[_Entry]) -> None:
    for name in os.listdir(dir_fd):
        relative = prefix + name
        budget.admit(relative)
        seen = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        executable = bool(seen.st_mode & stat.S_IXUSR)
        if not stat.S_ISLNK(seen.st_mode) and _kept_from_others(seen.st_mode):
            # The node makes every file readable (0644): a key the tool could not read here
            # would be sent over the wire and read there.
            raise SandboxUnavailable(
                f"the tool folder holds {relative!r}, which not every user may read: dispatch"
                " would make it readable on the node (chmod o+rX it, or move it out of the folder)"
            )
        if stat.S_ISLNK(seen.st_mode):
            target = _encoded(os.readlink(name, dir_fd=dir_fd))
            if len(target) > MAX_PATH_BYTES:
                raise BundleTooLarge(
                    f"the tool folder holds a link target longer than {MAX_PATH_BYTES} bytes"
                )
            found.append(_Entry(relative, "link", False, target))
        elif stat.S_ISDIR(seen.st_mode):
            found.append(_Entry(relative, "dir", executable, b""))
            child = _open_same(name, dir_fd, seen, os.O_DIRECTORY)
            try:
                _read_folder(child, relative + "/", budget, found)
            finally:
                os.close(child)
        elif stat.S_ISREG(seen.st_mode):
            fd = _open_same(name, dir_fd, seen, 0)
            try:
                content = _read_at_most(fd, budget.content_left)
            finally:
                os.close(fd)
            if len(content) > budget.content_left:
                raise budget.too_large()
            budget.content_left -= len(content)
            found.append(_Entry(relative, "file", executable, content))
        else:
            raise SandboxUnavailable(f"the tool folder holds {relative!r}, which is not a file")


def _kept_from_others(mode: int) -> bool:
    """Whether other users may not read a file (or list and enter a folder) of ``mode``."""
    wanted = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & wanted != wanted


def _open_same(name: str, dir_fd: int, seen: os.stat_result, flags: int) -> int:
    """``name`` in ``dir_fd`` opened without following a link, and the entry ``seen`` was.

    Raises:
        OSError: it cannot be opened (a link swapped in: ``ELOOP``) or is another entry
            than the listing saw (``ESTALE``).
    """
    fd = os.open(name, _OPEN_FLAGS | flags, dir_fd=dir_fd)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino) or stat.S_IFMT(
        opened.st_mode
    ) != stat.S_IFMT(seen.st_mode):
        os.close(fd)
        raise OSError(errno.ESTALE, "an entry changed while the folder was read")
    return fd


def _read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of ``fd`` (one more tells that it holds more)."""
    chunks: list[bytes] = []
    left = limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _encoded(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


class _BoundedBuffer(io.BytesIO):
    """The archive as it is written, refused as soon as it grows past its bound."""

    def __init__(self, budget: _Budget) -> None:
        super().__init__()
        self._budget = budget

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self._budget.max_bytes:
            raise self._budget.too_large()
        return super().write(data)


def pack(folder: Path, max_bytes: int) -> ToolBundle:
    """``folder`` as a tar and the content hash of the same bytes (blocking: a thread's work).

    ``max_bytes`` bounds the archive itself (headers, names, link targets and padding
    included), besides ``MAX_ENTRIES`` and ``MAX_PATH_BYTES``.

    Raises:
        BundleTooLarge: the archive would be larger than ``max_bytes``, or the folder holds
            too many entries or too long a path or link target.
        SandboxUnavailable: the folder cannot be read, changed while it was read, or holds
            what cannot be shipped (a device, a socket, a fifo).
    """
    budget = _Budget(max_bytes)
    tree, out = _TreeHash(), _BoundedBuffer(budget)
    try:
        entries = _read_tree(folder, budget)
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in entries:
                tree.add(entry)
                tar.addfile(*_tar_member(entry))
    except OSError as exc:
        raise SandboxUnavailable(f"the tool folder cannot be read: {exc.strerror}") from exc
    return ToolBundle(out.getvalue(), tree.hexdigest())


def _tar_member(entry: _Entry) -> tuple[tarfile.TarInfo, io.BytesIO | None]:
    info = tarfile.TarInfo(entry.relative)
    info.mode = 0o755 if entry.executable else 0o644
    info.mtime = 0
    if entry.kind == "link":
        info.type, info.mode = tarfile.SYMTYPE, 0o777
        info.linkname = entry.content.decode("utf-8", errors="surrogateescape")
        return info, None
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
        return info, None
    info.size = len(entry.content)
    return info, io.BytesIO(entry.content)


def tree_hash(root: Path) -> str:
    """The content hash of the folder ``root`` as it is on disk (what ``pack`` computes).

    Raises:
        SandboxUnavailable: an entry cannot be read or is not a file, folder or link.
    """
    tree = _TreeHash()
    try:
        for entry in _read_tree(root, _Budget(sys.maxsize)):
            tree.add(entry)
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
                extract(tar, str(staging), MAX_ENTRIES, MAX_PATH_BYTES)
        except (tarfile.TarError, OSError, ValueError) as exc:  # ValueError: a malformed header
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
