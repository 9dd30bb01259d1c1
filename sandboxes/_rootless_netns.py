"""A network namespace for a sandbox when the runner is not root.

An unprivileged process may make a network namespace only together with a user
namespace of its own, and may enter one only from inside that user namespace, which a
threaded process (the runner) cannot join. So a short-lived helper
(``sandboxes._netns_helper``) does it: it makes a new user namespace (mapping the
runner's uid and gid to themselves, nothing else) and a network namespace owned by it,
brings ``lo`` up, opens the egress listener on its ``127.0.0.1`` when asked, and hands
the runner descriptors of both namespaces (and the listener) over a socket pair before
exiting. The runner holds them as root holds its
namespace: slirp4netns joins them by path, the launcher enters them with ``nsenter``.

The tool's own user namespace is made by bubblewrap inside this one, with every
capability dropped, so the tool is root of nothing that owns its network namespace and
cannot change its interfaces or routes, as under root.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Bounds a helper that neither answers nor exits (it needs a few tens of milliseconds).
HELPER_TIMEOUT_S = 10.0
# Isolated and without site, as the watchdog; its module imports only what it needs, as
# each call with a network waits for it.
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from sandboxes._netns_helper import main; main(sys.argv)"
)


class RootlessNamespaceError(OSError):
    """The helper could not make the namespaces (user namespaces disabled, port taken)."""


@dataclass
class HeldNamespaces:
    """Descriptors of the helper's user and network namespaces, and its listener."""

    user_fd: int
    net_fd: int
    listener: socket.socket | None


def open_namespaces(port: int | None) -> HeldNamespaces:
    """A new user namespace and a network namespace it owns (``lo`` up); with ``port``,
    a listener on ``127.0.0.1:port`` inside. Blocking.

    Raises:
        RootlessNamespaceError: the helper failed; its message says why.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    package = str(Path(__file__).resolve().parent.parent)
    argv = [sys.executable, "-I", "-S", "-c", _BOOT, package, str(theirs.fileno()), str(port or 0)]
    with ours, theirs:
        try:
            helper = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        except OSError as exc:
            problem = f"cannot start the namespace helper: {exc.strerror}"
            raise RootlessNamespaceError(exc.errno, problem) from exc
        theirs.close()
        ours.settimeout(HELPER_TIMEOUT_S)
        try:
            message, fds, _, _ = socket.recv_fds(ours, 512, 3, socket.MSG_CMSG_CLOEXEC)
        except OSError:
            message, fds = b"", []
        finally:
            try:
                _, stderr = helper.communicate(timeout=HELPER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                helper.kill()
                _, stderr = helper.communicate()
    wanted = 3 if port else 2
    if message != b"ok" or len(fds) != wanted:
        for fd in fds:
            os.close(fd)
        said = message.decode(errors="replace") or _last_line(stderr) or "no message"
        raise RootlessNamespaceError(0, said[:160])
    listener = socket.socket(fileno=fds[2]) if port else None
    if listener is not None:
        listener.setblocking(False)
    return HeldNamespaces(fds[0], fds[1], listener)


def _last_line(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""
