"""The helper of ``sandboxes._rootless_netns``, in a process of its own: it makes a user
namespace and a network namespace it owns, and hands descriptors of both (and of the
egress listener) to the runner. Only the standard library's lightest modules: every call
with a network waits for this process to start.
"""

import fcntl
import os
import socket
import struct

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
LISTEN_BACKLOG = 64


def main(argv: list[str]) -> None:
    """``argv``: the boot's, then the socket to answer on and the listener's port (0: none)."""
    channel = socket.socket(fileno=int(argv[2]))
    try:
        fds = _make(int(argv[3]))
    except OSError as exc:
        channel.sendall(f"cannot make the tool's network namespace: {exc.strerror or exc}".encode())
        return
    socket.send_fds(channel, [b"ok"], fds)


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12 on
        os.unshare(flags)
        return
    import ctypes  # only here: it costs more than the rest of the start-up

    if ctypes.CDLL(None, use_errno=True).unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare: {os.strerror(errno)}")


def _make(port: int) -> list[int]:
    uid, gid = os.geteuid(), os.getegid()
    _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    # Only the runner's own ids: nothing else exists in there, root included.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    fds = [os.open("/proc/self/ns/user", os.O_RDONLY), os.open("/proc/self/ns/net", os.O_RDONLY)]
    if port:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", port))
        listener.listen(LISTEN_BACKLOG)
        fds.append(listener.detach())  # kept open for the hand-over
    return fds
