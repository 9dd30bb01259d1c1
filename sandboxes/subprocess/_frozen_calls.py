"""What passes between the runner and a call's process while the runner sets it up
(``_frozen``): its sockets, accepted from it alone, and its cgroup's descriptors, which
it writes itself."""

from __future__ import annotations

import array
import os
import select
import socket
import struct
import time
from pathlib import Path

from sandboxes.subprocess._ptrace import Injector, TraceError

SYS_WRITE, SYS_CLOSE, SYS_RECVMSG, MSG_CMSG_CLOEXEC = 1, 3, 47, 0x40000000
CONNECT_S = 5.0  # for a call's process to be seen on its sockets


def accepted(listener: socket.socket, pid: int) -> socket.socket:
    """The connection of process ``pid`` (by the kernel's word, SO_PEERCRED); any other
    is closed unread."""
    deadline = time.monotonic() + CONNECT_S
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([listener], [], [], left)[0]:
            break
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            continue
        peer = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        if peer == pid:
            connection.setblocking(False)
            return connection
        connection.close()
    raise TraceError(0, f"the call's process {pid} was not seen on its socket")


def join(call: Injector, io: socket.socket, tasks: list[Path]) -> None:
    """The call's process joins its cgroup by writing 0 to each of ``tasks``, through
    descriptors this process opened and sends it over its socket (``io``, its stdin): a
    process that moves itself spares the kernel's global lock, whose writer waits for an
    RCU grace period (``CallCgroup.join_files``), long on an idle machine."""
    fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in tasks]
    try:
        io.sendmsg([b"j"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    finally:
        for fd in fds:
            os.close(fd)
    space = socket.CMSG_SPACE(4 * len(fds))
    byte, control = call.put(bytes(1)), call.put(bytes(space))
    iov = call.put(struct.pack("QQ", byte, 1))
    header = call.put(struct.pack("QI4xQQQQi4x", 0, 0, iov, 1, control, space, 0))
    if call.checked(SYS_RECVMSG, 0, header, MSG_CMSG_CLOEXEC) != 1:
        raise TraceError(0, "the call's process did not receive its cgroup")
    data = call.read(control, space)
    length, level, kind = struct.unpack_from("Qii", data)
    received = array.array("i", data[16:length])
    if (level, kind, len(received)) != (socket.SOL_SOCKET, socket.SCM_RIGHTS, len(fds)):
        raise TraceError(0, "the call's process did not receive its cgroup")
    zero = call.text("0")
    for fd in received:
        call.checked(SYS_WRITE, fd, zero, 1)
        call.checked(SYS_CLOSE, fd)
