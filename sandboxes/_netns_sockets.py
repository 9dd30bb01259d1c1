"""What the TCP sockets of a sandbox's network namespace hold, for what no cgroup counts.

A connection waiting in a listener's accept queue is charged to no cgroup until a
process accepts it, and its receive queue holds up to the listener's buffer size (up to
twice the host's ``net.core.rmem_max``): a tool that never accepts pins hundreds of MB
behind one listener while its cgroup shows nothing. The sandbox's network namespace does
hold every such socket, so ``SocketWatch`` reads it: each poll, how many TCP sockets it
has (its ``/proc/PID/net/sockstat``, cheap); only when that many could hold more than the
budget, at most every ``DUMP_EVERY_S``, what they hold, asked of the kernel with one
``NETLINK_SOCK_DIAG`` dump per family (a dump walks the host's whole table of
connections: milliseconds, hence the gate and the pace). A socket holds its receive and
send queues and what it has reserved (``SK_MEMINFO_RMEM_ALLOC``, ``WMEM_QUEUED``,
``FWD_ALLOC``, ``BACKLOG``).

A netlink socket belongs to the namespace it was made in: it is made in a thread that
joins the sandbox's namespace (``sandboxes._netns``) and read from anywhere afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from sandboxes._netns import NamespaceError, _checked, _in_own_thread, _libc

CLONE_NEWNET = 0x40000000
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_SKMEMINFO = 7
ALL_STATES = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBBI48x")  # inet_diag_req_v2; a zero socket id: all of them
_MESSAGE_SIZE = 72  # inet_diag_msg
_ATTRIBUTE = struct.Struct("=HH")
_HELD = (0, 4, 5, 7)  # SK_MEMINFO_ RMEM_ALLOC, FWD_ALLOC, WMEM_QUEUED, BACKLOG
_RECEIVE_BYTES = 65536
DUMP_EVERY_S = 0.25
# A dump ends with NLMSG_DONE; never wait past this for it (it is read on the event loop).
DUMP_TIMEOUT_S = 0.5
# One packet past a full receive queue (loopback's MTU).
_OVERSHOOT = 65536


def _host_int(path: str, index: int = 0, default: int = 4 * 1024 * 1024) -> int:
    try:
        return int(Path(path).read_text().split()[index])
    except (OSError, ValueError, IndexError):
        return default


def most_one_socket_holds() -> int:
    """What one socket no cgroup counts may hold: the receive buffer a listener may ask for
    (twice ``rmem_max``) or is given (``tcp_rmem``'s default), a send buffer likewise, and
    one packet more."""
    buffers = (
        _host_int("/proc/sys/net/core/rmem_max"),
        _host_int("/proc/sys/net/core/wmem_max"),
        _host_int("/proc/sys/net/ipv4/tcp_rmem", 1),
        _host_int("/proc/sys/net/ipv4/tcp_wmem", 1),
    )
    return 2 * max(buffers) + _OVERSHOOT


class SocketWatch:
    """The TCP sockets of one sandbox's network namespace, against a budget in bytes."""

    def __init__(self, sockstat: int, namespace: int, budget: int) -> None:
        self._sockstat = sockstat
        self._namespace: int | None = namespace
        self._diag: socket.socket | None = None
        self._budget = budget
        self._per_socket = most_one_socket_holds()
        self._next_dump = 0.0
        self._sequence = 0
        self.held = 0  # bytes at the last dump

    @classmethod
    def of_members(cls, pids: Iterable[int], budget: int) -> SocketWatch | None:
        """Watch the namespace of the first of ``pids`` (a sandbox's processes) that is not in
        the runner's own; None when none is (yet).

        A pid is pinned with a pidfd before its ``/proc`` files are opened and found alive
        after: the files are that process's, not those of one that took its pid since.
        """
        home = Path("/proc/self/ns/net").stat().st_ino
        for pid in pids:
            opened: list[int] = []
            try:
                opened.append(os.pidfd_open(pid))
                opened.append(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
                if os.fstat(opened[1]).st_ino != home:
                    opened.append(os.open(f"/proc/{pid}/net/sockstat", os.O_RDONLY | os.O_CLOEXEC))
                    signal.pidfd_send_signal(opened[0], 0)  # still the process pinned
                    watch = cls(opened[2], opened[1], budget)
                    del opened[1:]  # the watch's now
                    return watch
            except OSError:
                pass  # gone already, or not ours to see
            finally:
                for fd in opened:
                    os.close(fd)
        return None

    def sockets(self) -> int:
        """How many TCP sockets the namespace has (listening, connected, not yet accepted)."""
        for line in os.pread(self._sockstat, 4096, 0).decode().splitlines():
            if line.startswith("TCP:"):
                fields = line.split()
                return int(fields[fields.index("inuse") + 1])
        return 0

    def over_budget(self) -> bool:
        """Whether the namespace's sockets hold more than the budget, as of the last dump.

        Raises:
            OSError: the namespace or the kernel's answer cannot be read.
        """
        if self.sockets() * self._per_socket <= self._budget:
            return False
        now = time.monotonic()
        if now >= self._next_dump:
            self.held = sum(self._dump(family) for family in (socket.AF_INET, socket.AF_INET6))
            self._next_dump = now + DUMP_EVERY_S
        return self.held > self._budget

    def _diag_socket(self) -> socket.socket:
        if self._diag is not None:
            return self._diag
        namespace = self._namespace
        assert namespace is not None

        def make() -> socket.socket:
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _checked(_libc.setns(namespace, CLONE_NEWNET), "setns")
                diag = socket.socket(
                    socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG
                )
                try:
                    _checked(_libc.setns(home, CLONE_NEWNET), "setns")
                except BaseException:
                    diag.close()
                    raise
                return diag
            finally:
                os.close(home)

        try:
            self._diag = _in_own_thread(make)
            self._diag.settimeout(DUMP_TIMEOUT_S)
        except NamespaceError:
            raise
        except OSError as exc:
            raise NamespaceError(exc.errno, f"cannot read the sandbox's sockets: {exc.strerror}") from exc
        return self._diag

    def _dump(self, family: int) -> int:
        diag = self._diag_socket()
        self._sequence += 1
        request = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_SKMEMINFO - 1), 0, ALL_STATES)
        flags = NLM_F_REQUEST | NLM_F_DUMP
        diag.sendall(
            _HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, flags, self._sequence, 0) + request
        )
        held = 0
        while True:
            data = diag.recv(_RECEIVE_BYTES)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _, sequence, _ = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size:
                    raise OSError("a malformed sock_diag answer")
                if sequence == self._sequence:
                    if kind == NLMSG_DONE:
                        return held
                    if kind == NLMSG_ERROR:
                        (code,) = struct.unpack_from("=i", data, offset + _HEADER.size)
                        raise OSError(-code, os.strerror(-code))
                    if kind == SOCK_DIAG_BY_FAMILY:
                        held += _held_by(data, offset + _HEADER.size + _MESSAGE_SIZE, offset + length)
                offset += (length + 3) & ~3

    def close(self) -> None:
        """Let the namespace go. Safe to call twice."""
        if self._diag is not None:
            self._diag.close()
            self._diag = None
        for fd in (self._sockstat, self._namespace):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._sockstat, self._namespace = -1, None


def _held_by(data: bytes, start: int, end: int) -> int:
    """What one socket holds, from its ``INET_DIAG_SKMEMINFO`` attribute (0 without one)."""
    count = max(_HELD) + 1
    while start + _ATTRIBUTE.size <= end:
        length, kind = _ATTRIBUTE.unpack_from(data, start)
        if length < _ATTRIBUTE.size:
            break
        if kind == INET_DIAG_SKMEMINFO and length >= _ATTRIBUTE.size + 4 * count:
            values = struct.unpack_from(f"={count}I", data, start + _ATTRIBUTE.size)
            return sum(values[i] for i in _HELD)
        start += (length + 3) & ~3
    return 0


class SandboxSockets:
    """A sandbox's ``SocketWatch``, made once one of its processes is in its namespace."""

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._watch: SocketWatch | None = None

    def over_budget(self, members: Callable[[], Iterable[int]]) -> bool:
        """Whether the sockets of the namespace of ``members`` (the sandbox's processes,
        read while none is found) hold more than the budget; False when that cannot be
        read (the sandbox is gone)."""
        try:
            if self._watch is None:
                self._watch = SocketWatch.of_members(members(), self._budget)
            return self._watch is not None and self._watch.over_budget()
        except OSError:
            return False

    def close(self) -> None:
        """Let the namespace go. Safe to call twice."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
