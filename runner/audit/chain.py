"""The hash chain of a tamper-evident audit log (``audit: {chain: true}``).

Each event gets ``prevHash`` (the ``hash`` of the file's last line, ``GENESIS`` when the
file is empty or its last line carries no hash) and then ``hash``: the SHA-256 (with a key,
``audit.key``: the HMAC-SHA256 under it; ``runner.audit.key``), in lower-case hex, of the
event without ``hash`` written as canonical JSON (``canonical``: keys sorted, no
spaces, ``ensure_ascii``). The line on disk is exactly that canonical text with
``,"hash":"<64 hex>"`` put before its closing brace, so an auditor can check a line with any
tool: cut the last 75 characters, put back ``}``, hash (``docs/audit.md``).

Several runner processes may append to one file. Each append holds an exclusive ``flock``
around "read the last line's hash from the file, compute, append": the previous hash always
comes from the file itself, never from memory, because another process may have appended
since. The lock orders the writers; the chain is the order of the lines. The lock is taken on
a lock file of its own beside the log (``lock_path``), private to the runner's user: a
``flock`` needs only a read-only descriptor, so anyone allowed to read the log itself (a log
shipper) could otherwise hold it and stall or drop every event.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import os
import re
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.audit.files import open_log_file

GENESIS = "0" * 64  # the prevHash of a file's first chained event
HASH_FIELD = "hash"
PREV_FIELD = "prevHash"
_SUFFIX_START = ',"hash":"'
SUFFIX_LENGTH = len(_SUFFIX_START) + 64 + len('"}')  # 75: what a chained line ends with
# How a chained line ends (its newline, when it has one, included).
_ENDING = re.compile(rb',"hash":"([0-9a-f]{64})"\}\n?\Z')
TAIL_CHECK_BYTES = 64 * 1024  # far past any line the runner writes (16 KiB and the chain fields)
LOCK_WAIT_S = 5.0  # a writer holds the lock for microseconds; 5 s means a stuck or hostile holder
_LOCK_PAUSE_S = 0.0002  # first pause between tries, doubled up to _LOCK_PAUSE_MAX_S
_LOCK_PAUSE_MAX_S = 0.01


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
# Between the two halves of a prepared event: a newline, which JSON text from the encoder never holds.
_HALVES = "\n"


def canonical(event: Mapping[str, Any]) -> str:
    """The text that is hashed: sorted keys, no spaces, ASCII only (``\\uXXXX`` escapes).

    Raises:
        ValueError: a float that is NaN or infinite (the audit processors never pass one).
    """
    return _ENCODER.encode(event)


def digest(body: bytes, key: bytes | None = None) -> str:
    """The hash of a line's hashed text: SHA-256, or HMAC-SHA256 under ``key``."""
    if key is None:
        return hashlib.sha256(body).hexdigest()
    return hmac.digest(key, body, "sha256").hex()


def prepare(event: Mapping[str, Any]) -> str:
    """``event`` ready for ``ChainedFileSink.write``: the canonical JSON of its keys that sort
    before ``prevHash`` and of those after, joined by a newline. Everything costly is done here,
    outside the lock; under it only ``prevHash`` is put between the halves and hashed.

    Raises:
        ValueError: as ``canonical``.
    """
    before = {key: value for key, value in event.items() if key < PREV_FIELD and key != HASH_FIELD}
    after = {key: value for key, value in event.items() if key > PREV_FIELD}
    return f"{canonical(before)}{_HALVES}{canonical(after)}"


def _assemble(prepared: str, prev_hash: str, key: bytes | None = None) -> str:
    """The chained line (without newline) of a prepared event."""
    before, separator, after = prepared.partition(_HALVES)
    if not separator or not before.startswith("{") or not after.endswith("}"):
        raise ValueError("not an event made by prepare()")
    head = f"{before[:-1]}," if len(before) > 2 else "{"
    tail = f",{after[1:]}" if len(after) > 2 else "}"
    body = f'{head}"{PREV_FIELD}":"{prev_hash}"{tail}'
    return f'{body[:-1]}{_SUFFIX_START}{digest(body.encode("ascii"), key)}"}}'


def chained_line(event: Mapping[str, Any], prev_hash: str, key: bytes | None = None) -> str:
    """``event`` with ``prevHash`` and ``hash`` (keyed with ``key``), as the line to append
    (without newline)."""
    return _assemble(prepare(event), prev_hash, key)


def split_line(line: bytes) -> tuple[bytes, str] | None:
    """A chained line (without newline) as (the hashed text, its claimed hash); None when the
    line does not end as a chained line does."""
    if len(line) <= SUFFIX_LENGTH:
        return None
    found = _ENDING.match(line, len(line) - SUFFIX_LENGTH)
    if found is None:
        return None
    return line[:-SUFFIX_LENGTH] + b"}", found.group(1).decode("ascii")


def lock_path(path: Path) -> Path:
    """The lock file every writer of the chained log at ``path`` locks: ``.<name>.lock`` beside it."""
    return path.with_name(f".{path.name}.lock")


def ends_chained(line: bytes) -> bool:
    """Whether ``line`` (its newline kept or not) ends as a chained line does; its hash is not
    checked (``runner audit verify`` does that)."""
    end = len(line) - 1 if line.endswith(b"\n") else len(line)
    return end > SUFFIX_LENGTH and _ENDING.match(line, end - SUFFIX_LENGTH) is not None


class ChainedFileSink:
    """Appends chained lines to a file, under an exclusive ``flock`` per line on ``lock_path``.

    The log is opened once, read-write and append-only, without following a symlink at
    its path (``O_NOFOLLOW``: a link planted there must not redirect the trail), and must
    be a regular file (its tail is read with ``pread``). The lock file likewise, and it must
    also belong to the runner's user and be closed to group and others. With ``key`` each
    hash is the HMAC-SHA256 under it.
    """

    def __init__(self, path: Path, key: bytes | None = None) -> None:
        """Raises ``OSError``: the log or its lock file cannot be opened, is a symlink
        (``ELOOP``) or is not a regular file; the lock file is another user's or open to others."""
        self.path = path
        self._key = key
        self._lock = threading.Lock()  # flock orders processes; threads share one descriptor
        fd = open_log_file(path, os.O_RDWR | os.O_APPEND, "the audit log", regular_only=True)
        try:
            lock_fd = open_log_file(
                lock_path(path), os.O_RDWR, "the audit log's lock file", regular_only=True
            )
        except OSError:
            os.close(fd)
            raise
        try:
            _check_private(lock_fd, lock_path(path))
        except OSError:
            os.close(fd)
            os.close(lock_fd)
            raise
        self._fd: int | None = fd
        self._lock_fd = lock_fd

    def tail_matches(self) -> bool | None:
        """Whether the file's last line carries the hash this sink would have given it; None
        when it is empty, or its last line is torn, unchained or longer than ``TAIL_CHECK_BYTES``.
        False means a key set, changed or removed since that line was written (or the line
        edited): what this sink appends will not verify together with what is there."""
        if self._fd is None:
            return None
        size = os.fstat(self._fd).st_size
        start = max(size - TAIL_CHECK_BYTES, 0)
        tail = os.pread(self._fd, size - start, start)
        if not tail.endswith(b"\n"):
            return None
        cut = tail.rfind(b"\n", 0, len(tail) - 1)
        if cut < 0 and start > 0:
            return None  # the last line began before the bytes read
        parts = split_line(tail[cut + 1 : -1])
        return None if parts is None else digest(parts[0], self._key) == parts[1]

    def write(self, line: str) -> None:
        """Append one event, given as ``prepare`` made it, with its chain fields.

        Raises:
            OSError: not written whole, or the lock stayed held for ``LOCK_WAIT_S``.
            ValueError: ``line`` was not made by ``prepare``.
        """
        with self._lock:
            if self._fd is None:
                raise OSError(errno.EBADF, "the audit log is closed")
            fd = self._fd
            _lock_file(self._lock_fd)
            try:
                prev_hash, torn = _last_hash(fd)
                data = (("\n" if torn else "") + _assemble(line, prev_hash, self._key) + "\n").encode("ascii")
                written = os.write(fd, data)
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        if written != len(data):  # a full disk can take part of a line: verify will name it
            raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                os.close(self._lock_fd)
                self._fd = None


def _check_private(fd: int, path: Path) -> None:
    """Raises ``OSError`` (``EPERM``): the lock file is not the runner user's own, or group or
    others may open it (and so hold its lock)."""
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise OSError(
            errno.EPERM,
            f"the audit log's lock file {path} belongs to uid {info.st_uid}, not to the runner's "
            f"user ({os.geteuid()}): remove it",
        )
    if info.st_mode & 0o077:
        raise OSError(
            errno.EPERM,
            f"the audit log's lock file {path} is open to group or others "
            f"(mode {stat.S_IMODE(info.st_mode):04o}): chmod 600 it",
        )


def _lock_file(fd: int) -> None:
    """Take the exclusive lock, waiting at most ``LOCK_WAIT_S`` (never hang on a holder that
    does not let go)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass  # held by another writer: wait for it below, with a bound
    deadline = time.monotonic() + LOCK_WAIT_S
    pause = _LOCK_PAUSE_S
    while True:
        time.sleep(pause)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(errno.ETIMEDOUT, f"the audit log stayed locked for {LOCK_WAIT_S:g} s") from None
            pause = min(pause * 2, _LOCK_PAUSE_MAX_S)


def _last_hash(fd: int) -> tuple[str, bool]:
    """The hash of the file's last line (``GENESIS`` when it has none), and whether that line
    is torn (no newline: the next line must start on a line of its own)."""
    size = os.lseek(fd, 0, os.SEEK_END)  # the offset does not matter: O_APPEND writes at the end
    if size == 0:
        return GENESIS, False
    tail = os.pread(fd, SUFFIX_LENGTH + 1, max(size - SUFFIX_LENGTH - 1, 0))
    if not tail.endswith(b"\n"):
        return GENESIS, True
    found = _ENDING.match(tail, max(len(tail) - SUFFIX_LENGTH - 1, 0))
    return (found.group(1).decode("ascii") if found else GENESIS), False
