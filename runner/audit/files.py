"""Opening the audit trail's files (the audit log, its lock file, the operator log) as the
runner, often root, without being led to another file: never through a symbolic link at
the file's name or as its folder, never a FIFO (a reader could hold every write), never a
file of another user's, never in a folder every user may write to (but a sticky one).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}


def _make_folders(folder: Path) -> None:
    """The missing folders of ``folder`` made ``0755`` each, whatever the umask (a umask of
    000 made them open to every user, and so refused)."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for each in reversed(missing):
        with contextlib.suppress(FileExistsError):
            each.mkdir(0o755)


def open_log_file(path: Path, flags: int, what: str, *, regular_only: bool = False) -> int:
    """``path`` opened with ``flags`` (created 0600 when absent, its folders too); a regular
    file, or a character device (``/dev/null``: only root makes those) unless
    ``regular_only``. The descriptor is blocking.

    Raises:
        OSError: it cannot be opened, or is not to be used (the message says why).
    """
    if str(path) in STANDARD_STREAMS:  # links to this process's own descriptors
        return os.dup(STANDARD_STREAMS[str(path)])
    _make_folders(path.parent)
    try:
        folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(
                exc.errno, f"the folder of {what} {path} is a symbolic link, never followed"
            ) from exc
        raise
    try:
        where = os.fstat(folder)
        if where.st_mode & stat.S_IWOTH and not where.st_mode & stat.S_ISVTX:
            raise OSError(errno.EPERM, f"the folder of {what} {path} is writable by every user")
        flags |= os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(path.name, flags, 0o600, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{what} {path} is a symbolic link, never followed") from exc
        raise
    finally:
        os.close(folder)
    info = os.fstat(fd)
    problem = None
    if not (stat.S_ISREG(info.st_mode) or (stat.S_ISCHR(info.st_mode) and not regular_only)):
        problem = f"{what} {path} is not a regular file"
    elif info.st_uid not in (os.getuid(), 0):
        problem = f"{what} {path} belongs to uid {info.st_uid}"
    if problem is not None:
        os.close(fd)
        raise OSError(errno.EPERM, problem, str(path))
    os.set_blocking(fd, True)  # O_NONBLOCK only kept a FIFO at the path from blocking open
    return fd
