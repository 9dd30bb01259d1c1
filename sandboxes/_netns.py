"""Network namespaces the runner (root) makes for a sandbox, and sockets it opens inside.

``unshare(CLONE_NEWNET)`` and ``setns`` change the namespace of the calling *thread*
only, so each runs in a short-lived thread of its own: the event loop and every other
thread of the runner stay in the host's namespace, and a thread that could not get back
home simply ends. A socket keeps the namespace it was made in, so a listener made in
there serves the sandbox's loopback while the runner accepts on it from its own loop.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
# How many connections from the tool may wait for the runner's accept.
LISTEN_BACKLOG = 64

_libc = ctypes.CDLL(None, use_errno=True)


class NamespaceError(OSError):
    """A namespace could not be made or entered (not root, no kernel support)."""


def _checked(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise NamespaceError(errno, f"{what}: {os.strerror(errno)}")


def _in_own_thread(work: Callable[[], T]) -> T:
    """Run ``work`` in a fresh thread that dies afterwards, whatever namespace it is in."""
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)

    thread = threading.Thread(target=target, name="runner-netns")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _enter(fd: int) -> None:
    _checked(_libc.setns(fd, CLONE_NEWNET), "setns")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def new_namespace() -> int:
    """A new network namespace with only ``lo`` (up); a descriptor that holds it.

    Raises:
        NamespaceError: the runner may not make one (it is not root) or the kernel refused.
    """

    def make() -> int:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _checked(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            held = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _loopback_up()
                _enter(home)
            except BaseException:
                os.close(held)
                raise
            return held
        finally:
            os.close(home)

    try:
        return _in_own_thread(make)
    except NamespaceError:
        raise
    except OSError as exc:
        raise NamespaceError(exc.errno, f"cannot set up the network namespace: {exc.strerror}") from exc


def listen_inside(namespace: str | int, port: int) -> socket.socket:
    """A TCP socket listening on ``127.0.0.1:port`` of the namespace at ``namespace``
    (a path such as ``/proc/PID/ns/net``, or a descriptor of one).

    Raises:
        NamespaceError: the namespace cannot be entered or the port is taken in it.
    """

    def make() -> socket.socket:
        opened = isinstance(namespace, str)
        target = os.open(namespace, os.O_RDONLY | os.O_CLOEXEC) if isinstance(namespace, str) else namespace
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _enter(target)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind(("127.0.0.1", port))
                listener.listen(LISTEN_BACKLOG)
                listener.setblocking(False)
                _enter(home)
            except BaseException:
                listener.close()
                raise
            return listener
        finally:
            os.close(home)
            if opened:
                os.close(target)

    try:
        return _in_own_thread(make)
    except NamespaceError:
        raise
    except OSError as exc:
        raise NamespaceError(exc.errno, f"cannot listen inside the sandbox: {exc.strerror}") from exc
