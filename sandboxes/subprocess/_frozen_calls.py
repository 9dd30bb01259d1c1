"""A call's process in fork mode, set up by the runner before it runs anything of its own
(``_frozen``): its sockets, accepted from it alone, its cgroup's descriptors, which it
writes itself, its uid, mounts, network, limits and capabilities, each made by a system
call the runner makes it make, and checked from outside."""

from __future__ import annotations

import array
import contextlib
import errno
import os
import signal
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from sandboxes._kernel import ready
from sandboxes._watchdog import parent_and_start
from sandboxes.subprocess._cgroup import CallCgroup, CgroupFactory
from sandboxes.subprocess._frozen_checks import capabilities
from sandboxes.subprocess._ptrace import EVENT_STOP, WALL, Injector, Regs, TraceError, stop_of

SYS_WRITE, SYS_CLOSE, SYS_RECVMSG, MSG_CMSG_CLOEXEC = 1, 3, 47, 0x40000000
SYS_DUP2, SYS_SOCKET, SYS_CONNECT, SYS_CHDIR, SYS_OPENAT = 33, 41, 42, 80, 257
SYS_IOCTL, SIOCSIFFLAGS, LOOPBACK_UP = 16, 0x8914, 0x1 | 0x8 | 0x40  # IFF_UP, IFF_LOOPBACK, IFF_RUNNING
SYS_CAPSET, SYS_MOUNT, SYS_PRLIMIT64, RLIMIT_CPU = 126, 165, 302, 0
SYS_RT_SIGPROCMASK, SIG_SETMASK, SIGSET_BYTES = 14, 2, 8
SYS_SETSID, SYS_UNSHARE, CLONE_NEWCGROUP = 112, 272, 0x02000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
AT_FDCWD, O_RDONLY, O_WRONLY = -100, 0, 1
CAPABILITY_V3 = 0x20080522
# Made in each call's process through the tracer (``_seccomp``'s traced filter): its
# cgroup namespace, and its mounts of /, /tmp, /dev/shm, /dev/pts and /proc.
TRACED_CALLS = 6
CONNECT_S = 5.0  # for a call's process to be seen on its sockets
ENDS = ("in", "out", "err")  # its sockets, as 0, 1 and 2


@dataclass(frozen=True)
class CallSetUp:
    """What each call's process of a template is given before it runs anything of its own."""

    cgroups: CgroupFactory  # its cgroup is made from it, with these limits
    memory_mb: int
    max_pids: int
    cpu_seconds: int
    disk_mb: int
    calls: tuple[Path, str]  # the folder of the calls' sockets: on the host, in the sandbox


@dataclass(frozen=True)
class Inside:
    """What every call of one template starts with: the uid and gid it runs as, its
    working folder, and its signal mask (the template's, before it was frozen)."""

    uid: int
    cwd: str
    mask: int


@dataclass(frozen=True)
class Cloned:
    """A call's process: set up and stopped before its first instruction while its tracer
    holds it, then running."""

    pid: int
    pidfd: int
    group: CallCgroup  # its cgroup: removed with it
    stdin: socket.socket
    stdout: socket.socket
    stderr: socket.socket

    def close_sockets(self) -> None:
        for sock in (self.stdin, self.stdout, self.stderr):
            sock.close()

    def drop(self) -> None:
        """Kill it, reap it while its tracer holds it (traced: ours to reap first) and
        remove what it had."""
        reap_quietly(self.pidfd)
        self.close_sockets()
        self.group.remove()


def reaches_init(frozen: Injector) -> bool:
    """Whether the frozen template can open its sandbox's init's memory, trying it itself.
    Every call's parent, init must be out of its reach (its Landlock domain,
    ``runner_landlock.py``): only a refusal for want of the right proves it (another
    failure, say a descriptor limit, would prove nothing)."""
    mem = frozen.syscall(SYS_OPENAT, AT_FDCWD, frozen.text("/proc/1/mem"), O_RDONLY)
    if mem >= 0:
        frozen.checked(SYS_CLOSE, mem)
    return mem != -errno.EACCES


def reap_quietly(pidfd: int) -> None:
    """Kill the process of ``pidfd`` and reap it if it is still ours to (traced), then
    close ``pidfd``: never a pid that may have been reaped and given to another."""
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | WALL)
    os.close(pidfd)


def signalled(pid: int) -> bool:
    """Whether a signal waits for the held process ``pid`` (it would act in its call)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    pending = [line.split(":", 1)[1].strip() for line in lines if line.startswith(("SigPnd:", "ShdPnd:"))]
    return len(pending) != 2 or any(int(mask, 16) for mask in pending)


def listening(setup: CallSetUp) -> tuple[list[socket.socket], list[str]]:
    """A call's listeners (its stdin, stdout and stderr), under a name no one can guess
    in a folder no one can list, and their addresses as the template sees them."""
    folder, inside = setup.calls
    name = os.urandom(8).hex()
    listeners = []
    try:
        for end in ENDS:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listeners.append(listener)
            path = folder / f"{name}.{end}"
            listener.bind(str(path))
            path.chmod(0o666)
            listener.listen(1)
            listener.setblocking(False)
    except BaseException:
        close_listeners(listeners)
        raise
    return listeners, [f"{inside}/{name}.{end}" for end in ENDS]


def close_listeners(listeners: list[socket.socket]) -> None:
    for listener in listeners:
        path = listener.getsockname()
        listener.close()
        with contextlib.suppress(OSError):
            Path(path).unlink()


def accepted(listener: socket.socket, pid: int) -> socket.socket:
    """The connection of process ``pid`` (by the kernel's word, SO_PEERCRED); any other
    is closed unread."""
    deadline = time.monotonic() + CONNECT_S
    while (left := deadline - time.monotonic()) > 0:
        if not ready([listener.fileno()], left):
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


def join(call: Injector, stdin: socket.socket, tasks: list[Path]) -> None:
    """The call's process joins its cgroup by writing 0 to each of ``tasks``, through
    descriptors this process opened and sends it over its ``stdin`` socket: a
    process that moves itself spares the kernel's global lock, whose writer waits for an
    RCU grace period (``CallCgroup.join_files``), long on an idle machine."""
    fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in tasks]
    try:
        stdin.sendmsg([b"j"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
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


def set_up(
    child: int,
    base: Regs,
    group: CallCgroup,
    setup: CallSetUp,
    inside: Inside,
    listened: tuple[list[socket.socket], list[str]],
    connections: list[socket.socket],
) -> None:
    """Set up the call's process ``child``, cloned from the template stopped at ``base``,
    and check it. It is left stopped, its registers put back (once let go by its
    tracer, it returns from the template's read with nothing read). Its accepted sockets
    are appended to ``connections`` as they come (the caller's to close should this fail)."""
    if stop_of(child)[0] != EVENT_STOP:
        raise TraceError(0, f"the call's process {child} did not stop at its start")
    with Injector(child, base) as call:  # its memory's descriptor closed however it ends
        # A session and process group of its own: a signal another call sends its group
        # (``kill(0, ...)``) reaches neither this call nor the template, whose group the
        # clone would share, nor a process made ahead and held until its call.
        call.checked(SYS_SETSID)
        for name, line in (
            ("uid_map", f"{inside.uid} {inside.uid} 1"),
            ("setgroups", "deny"),
            ("gid_map", f"{inside.uid} {inside.uid} 1"),
        ):
            fd = call.checked(SYS_OPENAT, AT_FDCWD, call.text(f"/proc/self/{name}"), O_WRONLY)
            call.checked(SYS_WRITE, fd, call.text(line), len(line))
            call.checked(SYS_CLOSE, fd)
        listeners, addresses = listened
        for number, (listener, address_of) in enumerate(zip(listeners, addresses, strict=True)):
            sock = call.checked(SYS_SOCKET, socket.AF_UNIX, socket.SOCK_STREAM, 0)
            address = struct.pack("H", socket.AF_UNIX) + address_of.encode() + b"\0"
            call.checked(SYS_CONNECT, sock, call.put(address), len(address))  # before /run is covered
            if sock != number:
                call.checked(SYS_DUP2, sock, number)
                call.checked(SYS_CLOSE, sock)
            connections.append(accepted(listener, child))
        join(call, connections[0], group.join_files)  # before it runs anything
        # A cgroup namespace rooted at its own cgroup, as a sandbox's is: otherwise it sees
        # where that cgroup sits beside the template's, named after the runner and a count.
        call.checked(SYS_UNSHARE, CLONE_NEWCGROUP)
        call.checked(SYS_MOUNT, call.text("none"), call.text("/"), 0, MS_REC | MS_PRIVATE, 0)
        tmpfs, options = call.text("tmpfs"), call.text(f"size={setup.disk_mb}m,mode=1777")
        for target in ("/tmp", "/dev/shm"):  # noqa: S108 - the call's own
            call.checked(SYS_MOUNT, tmpfs, call.text(target), tmpfs, MS_NOSUID | MS_NODEV, options)
        devpts, pts = call.text("devpts"), call.text("newinstance,ptmxmode=0666,mode=0620")
        call.checked(SYS_MOUNT, devpts, call.text("/dev/pts"), devpts, MS_NOSUID | MS_NOEXEC, pts)
        proc = call.text("proc")  # its own pid namespace's: only itself
        call.checked(SYS_MOUNT, proc, call.text("/proc"), proc, MS_NOSUID | MS_NODEV | MS_NOEXEC, 0)
        call.checked(SYS_CHDIR, call.text(inside.cwd))  # whatever the import left, checked below
        # Its own network: loopback only, up (as bubblewrap's is), for a tool that talks to itself.
        inet = call.checked(SYS_SOCKET, socket.AF_INET, socket.SOCK_DGRAM, 0)
        call.checked(SYS_IOCTL, inet, SIOCSIFFLAGS, call.put(struct.pack("16sH22x", b"lo", LOOPBACK_UP)))
        call.checked(SYS_CLOSE, inet)
        limit = call.put(struct.pack("QQ", setup.cpu_seconds, setup.cpu_seconds + 1))  # SIGXCPU, then SIGKILL
        call.checked(SYS_PRLIMIT64, 0, RLIMIT_CPU, limit, 0)
        mask = call.put(struct.pack("Q", inside.mask))
        call.checked(SYS_RT_SIGPROCMASK, SIG_SETMASK, mask, 0, SIGSET_BYTES)
        header = call.put(struct.pack("Ii", CAPABILITY_V3, 0))
        call.checked(SYS_CAPSET, header, call.put(bytes(24)))  # nothing, in its user namespace
        # Checked from outside: each mount went through the tracer (a filter of the tool's
        # own could fake them; the freeze refuses one), the cgroup namespace is not its
        # parent's, and no capability is left.
        try:
            astray = (
                call.approved != TRACED_CALLS
                or _namespace(child, "cgroup") == _namespace(parent_and_start(child)[0], "cgroup")
                or capabilities(child) != 0
                or str(Path(f"/proc/{child}/cwd").readlink()) != inside.cwd
            )
        except OSError as exc:  # it, or the template's sandbox, died meanwhile
            raise TraceError(0, f"the call's process {child} could not be checked: {exc}") from exc
        if astray:
            raise TraceError(0, f"the call's process {child} was not set up as asked")
        call.close(result=0)  # stopped still: when let go, it returns from the template's read


def _namespace(pid: int, kind: str) -> int:
    return Path(f"/proc/{pid}/ns/{kind}").stat().st_ino
