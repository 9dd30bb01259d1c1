"""Where ``runner serve --socket`` listens, and the checks both ends make on that place.

Standard library only: ``runner exec`` reads this on its fast path, before anything else of
the runner is imported.

The default is ``runner/serve.sock`` in the user's runtime folder: ``$XDG_RUNTIME_DIR``,
else ``/run/user/UID``, whichever is the user's own (``sandboxes.runtime_folder``); else
``$TMPDIR/runner-UID/serve.sock``. The folder holding the socket is created 0700 and
must be a real folder (never a symlink) owned by the user and writable by nobody else:
otherwise another user could put their own socket there and receive the calls.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from sandboxes.runtime_folder import own_folder_fault, runtime_folder

SOCKET_ENV = "RUNNER_SOCKET"  # a socket of the user's choosing, for `runner exec`
SOCKET_NAME = "serve.sock"
# The longest request line either end handles. Params are bounded at 8 MiB by the runner,
# their request and the line's envelope add little.
MAX_REQUEST_BYTES = 16 * 1024 * 1024


class SocketPlaceError(Exception):
    """The socket's folder or path is not safe to use (the message says why)."""


def default_socket(env: Mapping[str, str] | None = None) -> Path:
    """The socket ``runner serve --socket`` and ``runner exec`` use when none is named."""
    env = os.environ if env is None else env
    uid = os.getuid()
    runtime = runtime_folder(uid, env)
    if runtime is not None:
        return runtime / "runner" / SOCKET_NAME
    return Path(tempfile.gettempdir()) / f"runner-{uid}" / SOCKET_NAME


def own_folder(folder: Path, *, private: bool) -> None:
    """Check that ``folder`` is a real folder of this user that nobody else may write to
    (``private``: that nobody else may even enter).

    Raises:
        SocketPlaceError: it is missing, a symlink, someone else's, or too open.
    """
    if (fault := own_folder_fault(folder, os.getuid(), private=private)) is not None:
        raise SocketPlaceError(fault)


def prepare_folder(socket_path: Path, *, private: bool) -> None:
    """Create the socket's folder (0700) when it is missing, then check it (``own_folder``).

    Raises:
        SocketPlaceError: it cannot be created, or is not safe.
    """
    folder = socket_path.parent
    try:
        folder.mkdir(0o700)  # only the last part: the ones above it are the system's
    except FileExistsError:
        pass
    except OSError as exc:
        raise SocketPlaceError(f"cannot create {folder}: {exc.strerror or exc}") from None
    own_folder(folder, private=False)
    if private:
        # Ours, and no one else may write in it: closing it to others takes nothing from
        # anyone (a user's state folder, made 0755, is this folder without root). Through
        # a descriptor: the path may lead elsewhere by the time of a chmod.
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                if info.st_uid == os.getuid() and not info.st_mode & 0o022:
                    os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        own_folder(folder, private=True)


def is_own_socket(path: Path) -> bool:
    """Whether ``path`` is a socket (not a symlink to one) of this user, in a folder only
    this user can write to: the one place ``runner exec`` sends a call to unasked."""
    try:
        info = os.lstat(path)
        own_folder(path.parent, private=False)
    except (OSError, SocketPlaceError):
        return False
    return stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid()
