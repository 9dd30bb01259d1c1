"""A frozen template: the tool imported once in its sandbox, then stopped for good, and each
call cloned from it by the benchmark, from outside, with ptrace. Run by
``bench/fork_floor.py --frozen`` and ``FORK_LOOP=frozen bench/test_fork_hostile.py``.

The template (``bench/_fork_template.py --frozen``) imports the tool's helper, says ready
on its stdout and blocks in a read. From then on none of its code runs again: the
benchmark seizes and interrupts it, checks it from outside (the only process in its
sandbox, one thread, still bubblewrap's namespaces), closes every descriptor it has and
unmaps every shared mapping, by system calls it makes in it. For each call it makes the
template run one more, a ``clone`` into fresh user, mount, pid, IPC, network and UTS
namespaces (the child a sibling of the template, so bubblewrap's init reaps it), and,
before the child runs any instruction of its own: puts it in a fresh call cgroup, maps
its uid, mounts a fresh ``/tmp``, ``/dev/shm`` and ``/proc``, connects its stdin and
stdout to a socket of the benchmark's and its stderr to another, and drops every
capability it holds in its user namespace. Then the child returns from the template's
read and runs the tool's ``main.py``.

The template's seccomp filter is the sandbox's, except that ``mount`` and ``clone`` into
new namespaces go to the tracer rather than failing: made by the benchmark (the only
tracer there ever is) they go through, and made by the tool's code, untraced, they fail
(ENOSYS).
"""

from __future__ import annotations

import collections
import errno
import os
import queue
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sandboxes._identity import IdentityLease
from sandboxes._watchdog import ensure, parent_and_start, watch, watch_sandbox_init
from sandboxes.subprocess._cgroup import CallCgroup, CgroupFactory
from sandboxes.subprocess._ptrace import (
    CONT,
    DETACH,
    EVENT_STOP,
    INTERRUPT,
    O_EXITKILL,
    O_TRACECLONE,
    O_TRACEFORK,
    O_TRACESECCOMP,
    SEIZE,
    SETOPTIONS,
    Injector,
    Regs,
    TraceError,
    regs_of,
    request,
    stop_of,
)
from sandboxes.subprocess._seccomp import compiled_filter, sealed_memfd

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
FRESH = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
CLONE_PARENT, SIGCHLD = 0x8000, 17
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
SYS_READ, SYS_CLOSE, SYS_MUNMAP, SYS_DUP2, SYS_SOCKET, SYS_CONNECT = 0, 3, 11, 33, 41, 42
SYS_CLONE, SYS_WRITE, SYS_CAPSET, SYS_MOUNT, SYS_OPENAT = 56, 1, 126, 165, 257
SYS_RT_SIGPROCMASK, SIG_SETMASK, SIGSET_BYTES = 14, 2, 8
SYS_PRLIMIT64, RLIMIT_AS, ROOTLESS_AS_MB = 302, 9, 1024
AT_FDCWD, O_WRONLY = -100, 1
CAPABILITY_V3 = 0x20080522
# PIDFD_GET_INFO with PIDFD_INFO_EXIT (Linux 6.15): the wait status of a process that is
# not our child, told once its parent (bubblewrap's init) has reaped it, a moment after its
# pidfd says it exited; UNKNOWN_STATUS on older kernels or when the reap never comes.
PIDFD_GET_INFO, PIDFD_INFO_EXIT, PIDFD_INFO_SIZE = 0xC040FF0B, 1 << 3, 64
UNKNOWN_STATUS = -1
REAP_WAIT_S, REAP_POLL_S = 2.0, 0.0005
READY_TIMEOUT_S, CALL_TIMEOUT_S, KILL_WAIT_S = 30, 20, 10
MAX_OUTPUT_BYTES = 1 << 20
MOUNTS = 5  # made in each call's process: /, /tmp, /dev/shm, /dev/pts, /proc
STOP_TRIES = 200  # about 10 ms apart: a template not found in its read by then is refused


class FrozenTemplate:
    """The tool's frozen template in its sandbox, and the calls cloned from it; a
    ``Template`` of ``bench/fork_floor.py`` in what it offers."""

    def __init__(
        self,
        tool: Path,
        sandbox: list[str],
        python: str,
        script: Path,
        lease: IdentityLease | None,
        limits: tuple[int, int],
    ):
        # Rootless (no lease): the runner's own uid and no cgroup; each call's address
        # space is bounded by an rlimit instead (``ROOTLESS_AS_MB``).
        self._cgroups = CgroupFactory() if lease is not None else None
        # The runner's watchdog: should this process die, it removes the calls' cgroups
        # (and kills what is in them), and kills the template's sandbox (``_freeze``).
        if self._cgroups is not None:
            for parent in self._cgroups.parents:
                watch("cgroups", f"{self._cgroups.version}:{parent}")
        else:
            ensure()
        self._limits = limits
        self._lease = lease  # released by ``close``
        self.uid, self._gid = (lease.uid, lease.gid) if lease is not None else (os.getuid(), os.getgid())
        # In the folder bound into the sandbox (read-only: a socket is still reached), the
        # calls' sockets, by names that cannot be listed.
        self._calls = Path(tempfile.mkdtemp(prefix="calls-", dir=tool.parent))
        self._calls.chmod(0o711)
        counted = lease is not None
        seccomp = sealed_memfd("runner-seccomp", compiled_filter(memory_counted=counted, traced=True))
        argv = [*sandbox, "--seccomp", str(seccomp), "--", python, "-s", str(script), str(tool), "--frozen"]
        self.process = subprocess.Popen(
            argv, pass_fds=(seccomp,), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        os.close(seccomp)
        self._jobs: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = (
            queue.Queue()
        )
        ready: Future[None] = Future()
        self._tracer = threading.Thread(target=self._trace, args=(ready,), daemon=True, name="frozen-tracer")
        self._tracer.start()
        try:
            ready.result()
        except BaseException:
            self.close()
            raise

    # -- the tracer's thread: every ptrace request comes from it ------------------------

    def _trace(self, ready: Future[None]) -> None:
        try:
            self._template, self._base = self._freeze()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while (job := self._jobs.get()) is not None:
                work, args, done = job
                try:
                    done.set_result(work(*args))
                except BaseException as exc:
                    done.set_exception(exc)
        finally:
            os.kill(self._template, 9)

    def _freeze(self) -> tuple[int, Regs]:
        from fork_floor import TemplateRefused, _sandboxed, _untrustworthy

        assert self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_S)
        if not readable or os.read(self.process.stdout.fileno(), 1) != b"r":
            raise TemplateRefused("no ready from the template")
        sandbox = _sandboxed(self.process.pid)
        template = sandbox[1]
        watch_sandbox_init(sandbox[0], parent_and_start(sandbox[0])[1])  # its death takes all
        # Seized with no event to trace yet: until it is frozen, the tool's own mount or
        # clone into new namespaces meets a tracer that does not take them (ENOSYS).
        request(SEIZE, template, 0, O_EXITKILL)
        # The tracer and the template on one CPU: the thirty-odd round trips of a call's
        # setup then never wait for an idle core to wake up (docs/performance.md).
        self._cpus = os.sched_getaffinity(0)
        pinned = {min(self._cpus)}
        os.sched_setaffinity(0, pinned)  # this thread only
        os.sched_setaffinity(template, pinned)
        base = self._stop_in_read(template)
        # Stopped for good: what is checked now cannot change any more.
        threads = os.listdir(f"/proc/{template}/task")
        if len(threads) != 1:
            raise TemplateRefused(f"the import left {len(threads)} threads")
        if _status(template, "Seccomp_filters") != "1" or _status(template, "NoNewPrivs") != "1":
            raise TemplateRefused("the import loaded a system-call filter of its own")
        request(SETOPTIONS, template, 0, O_TRACEFORK | O_TRACECLONE | O_TRACESECCOMP | O_EXITKILL)
        try:
            frozen = Injector(template, base)
        except TraceError as exc:
            raise TemplateRefused(str(exc)) from exc
        # Every signal blocked in the template: a pending one (a timer the import set goes
        # on firing) would make each call's clone fail (ERESTARTNOINTR). A call gets back
        # the mask the template had; no timer or pending signal passes to it.
        self._mask = int(_status(template, "SigBlk"), 16)
        everything = frozen.put(struct.pack("Q", (1 << 64) - 1))
        frozen.checked(SYS_RT_SIGPROCMASK, SIG_SETMASK, everything, 0, SIGSET_BYTES)
        frozen.close()
        for fd in os.listdir(f"/proc/{template}/fd"):
            frozen.checked(SYS_CLOSE, int(fd))
        for low, high in _shared_mappings(template):
            frozen.checked(SYS_MUNMAP, low, high - low)
        problem = _untrustworthy(_sandboxed(self.process.pid), None)
        if problem:
            raise TemplateRefused(problem)
        return template, base

    def _stop_in_read(self, template: int) -> Regs:
        """Stop the template in its read of stdin (its ready comes just before: it may
        not be there yet), where each call's process returns from with nothing read."""
        from fork_floor import TemplateRefused

        where: collections.Counter[int] = collections.Counter()
        for _ in range(STOP_TRIES):
            request(INTERRUPT, template)
            event, _ = stop_of(template)
            while event != EVENT_STOP:
                # A signal on its way first: dropped, so its read goes on. Delivered, its
                # handler ran and the stop came in it, every time with a 10 ms timer.
                request(CONT, template)
                request(INTERRUPT, template)
                event, _ = stop_of(template)
            regs = regs_of(template)
            if regs.orig_rax == SYS_READ and regs.rdi == 0:
                return regs
            where[regs.orig_rax if regs.orig_rax < 1 << 63 else -1] += 1  # -1: not in a system call
            request(CONT, template)
            time.sleep(random.uniform(0.005, 0.015))  # never in step with a timer of the tool's
        raise TemplateRefused(f"the template never waited in its read of stdin (stopped in {dict(where)})")

    def _clone(self, tasks: list[Path], stdio: str, stderr: str) -> tuple[int, int]:
        """A call's process, cloned and set up, let go: its host pid and a pidfd of it."""
        template = Injector(self._template, self._base)
        template.checked(SYS_CLONE, FRESH | CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)
        (child,) = template.children
        if stop_of(child)[0] != EVENT_STOP:
            raise TraceError(0, f"the call's process {child} did not stop at its start")
        for path in tasks:  # joined before it runs anything
            path.write_text(str(child))
        call = Injector(child, self._base)
        for name, line in (
            ("uid_map", f"{self.uid} {self.uid} 1"),
            ("setgroups", "deny"),
            ("gid_map", f"{self._gid} {self._gid} 1"),
        ):
            fd = call.checked(SYS_OPENAT, AT_FDCWD, call.text(f"/proc/self/{name}"), O_WRONLY)
            call.checked(SYS_WRITE, fd, call.text(line), len(line))
            call.checked(SYS_CLOSE, fd)
        for path, numbers in ((stdio, (0, 1)), (stderr, (2,))):  # before /tmp is covered
            sock = call.checked(SYS_SOCKET, socket.AF_UNIX, socket.SOCK_STREAM, 0)
            address = struct.pack("H", socket.AF_UNIX) + path.encode() + b"\0"
            call.checked(SYS_CONNECT, sock, call.put(address), len(address))
            for number in numbers:
                if sock != number:
                    call.checked(SYS_DUP2, sock, number)
            if sock not in numbers:
                call.checked(SYS_CLOSE, sock)
        call.checked(SYS_MOUNT, call.text("none"), call.text("/"), 0, MS_REC | MS_PRIVATE, 0)
        tmpfs, options = call.text("tmpfs"), call.text("size=16m,mode=1777")
        for target in ("/tmp", "/dev/shm"):
            call.checked(SYS_MOUNT, tmpfs, call.text(target), tmpfs, MS_NOSUID | MS_NODEV, options)
        devpts, pts = call.text("devpts"), call.text("newinstance,ptmxmode=0666,mode=0620")
        call.checked(
            SYS_MOUNT, devpts, call.text("/dev/pts"), devpts, MS_NOSUID | MS_NOEXEC, pts
        )  # /dev/ptmx: a link
        proc = call.text("proc")  # its own pid namespace's: only itself
        call.checked(SYS_MOUNT, proc, call.text("/proc"), proc, MS_NOSUID | MS_NODEV | MS_NOEXEC, 0)
        if self._cgroups is None:
            limit = call.put(struct.pack("QQ", ROOTLESS_AS_MB << 20, ROOTLESS_AS_MB << 20))
            call.checked(SYS_PRLIMIT64, 0, RLIMIT_AS, limit, 0)
        mask = call.put(struct.pack("Q", self._mask))
        call.checked(SYS_RT_SIGPROCMASK, SIG_SETMASK, mask, 0, SIGSET_BYTES)
        header = call.put(struct.pack("Ii", CAPABILITY_V3, 0))
        call.checked(SYS_CAPSET, header, call.put(bytes(24)))  # nothing, in its user namespace
        # Checked from outside: each mount went through the tracer (a filter of the tool's
        # own could fake them: the template may have none, ``_freeze``), and no capability is left.
        if template.approved != 1 or call.approved != MOUNTS or _capabilities(child) != 0:
            raise TraceError(0, f"the call's process {child} was not set up as asked")
        pidfd = os.pidfd_open(child)
        os.sched_setaffinity(child, self._cpus)  # the call runs on any
        call.close(result=0)  # it returns from the template's read, with nothing read
        request(DETACH, child)
        return child, pidfd

    # -- any thread ---------------------------------------------------------------------

    def _on_tracer(self, work: Callable[..., Any], *args: Any) -> Any:
        done: Future[Any] = Future()
        self._jobs.put((work, args, done))
        return done.result()

    def call(
        self, payload: bytes, timeout_s: float = CALL_TIMEOUT_S, max_output: int = MAX_OUTPUT_BYTES
    ) -> tuple[bytes, int]:
        """Stdout and the wait status (``UNKNOWN_STATUS`` when the kernel cannot tell it)
        of one call.

        Raises:
            TimeoutError: the call did not end within ``timeout_s``.
            OutputOverflow: it wrote more than ``max_output`` bytes on stdout or stderr.
            LimitBroken: its cgroup saw an OOM kill, or a refused fork before it failed.
            Either way its process, and everything in its pid namespace, is dead first.
        """
        group = self._cgroups.create(*self._limits) if self._cgroups is not None else None
        name = os.urandom(16).hex()
        listeners = []
        try:
            for end in ("io", "err"):
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listeners.append(listener)
                listener.bind(str(self._calls / f"{name}.{end}"))
                os.chmod(self._calls / f"{name}.{end}", 0o666)
                listener.listen(1)
            paths = [listener.getsockname() for listener in listeners]
            tasks = group.join_files if group is not None else []
            child, pidfd = self._on_tracer(self._clone, tasks, *paths)
            deadline = time.monotonic() + timeout_s
            try:
                io, err = (_accept_from(listener, child, deadline) for listener in listeners)
                with io, err:
                    io.settimeout(max(deadline - time.monotonic(), 0.001))
                    io.sendall(payload)
                    io.shutdown(socket.SHUT_WR)
                    answer = _read_both(io, err, deadline, max_output)
                select.select([pidfd], [], [], max(deadline - time.monotonic(), 0.001))
                status = _exit_status(pidfd)
                _blame_limits(group, status)
                return answer, status
            except BaseException:
                _kill(pidfd)  # before the error goes up: nothing of the call outlives it
                raise
            finally:
                if group is None:  # pid 1 of its own pid namespace: everything in it goes too
                    with _quiet():
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
        finally:
            for listener in listeners:
                listener.close()
                with _quiet():
                    os.unlink(listener.getsockname())
            if group is not None:
                group.remove()  # kills what is left first

    def calls_running(self) -> list[int]:
        """The live processes in the template's sandbox besides the template: its calls'
        (a call's process that died is a zombie until bubblewrap's init reaps it)."""
        from fork_floor import _children, _descendants

        (init,) = _children(self.process.pid)
        found = []
        for pid in _descendants([pid for pid in _children(init) if pid != self._template]):
            with _quiet():
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(pid)
        return found

    def close(self) -> None:
        self._jobs.put(None)
        self._tracer.join(10)
        with _quiet():
            self.process.kill()
        self.process.wait(timeout=10)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(self._calls, ignore_errors=True)
        if self._lease is not None:
            self._lease.release()  # the template is gone, and each call went with its cgroup


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)  # type: ignore[arg-type]


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    return ""


def _capabilities(pid: int) -> int:
    return int(_status(pid, "CapEff") or "0", 16) | int(_status(pid, "CapPrm") or "0", 16)


def _shared_mappings(pid: int) -> list[tuple[int, int]]:
    found = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms[3] == "s":
            low, high = (int(part, 16) for part in span.split("-"))
            found.append((low, high))
    return found


def _accept_from(listener: socket.socket, pid: int, deadline: float) -> socket.socket:
    """The connection of process ``pid`` (by the kernel's word, SO_PEERCRED); any other
    is closed unread."""
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        connection, _ = listener.accept()
        peer = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        if peer == pid:
            return connection
        connection.close()
    raise TimeoutError(f"the call's process {pid} never connected")


class OutputOverflow(Exception):
    """A call wrote more than its cap."""


class LimitBroken(Exception):
    """A call broke its memory or process limit (``reason``: as the runner says it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _blame_limits(group: CallCgroup | None, status: int) -> None:
    """As the runner blames an outcome: an OOM kill is the memory limit's, whatever the
    status; a failure after a refused fork is the process limit's (a tool may cope)."""
    if group is None:
        return
    if group.oom_kills() > 0:
        raise LimitBroken("memory_limit")
    if status != 0 and group.pids_refused() > 0:
        raise LimitBroken("pids_limit")


def _read_both(io: socket.socket, err: socket.socket, deadline: float, cap: int) -> bytes:
    """Stdout, read to its end with stderr beside it (a tool that fills one while the
    other is read never waits), each up to ``cap``, by ``deadline``."""
    kept: dict[socket.socket, list[bytes]] = {io: [], err: []}
    sizes = {io: 0, err: 0}
    open_ = [io, err]
    for connection in open_:
        connection.setblocking(False)
    while open_:
        left = deadline - time.monotonic()
        readable, _, _ = select.select(open_, [], [], max(left, 0))
        if not readable:
            raise TimeoutError("the call did not end in time")
        for connection in readable:
            try:
                chunk = connection.recv(65536)
            except BlockingIOError:
                continue
            if not chunk:
                open_.remove(connection)
                continue
            sizes[connection] += len(chunk)
            if sizes[connection] > cap:
                raise OutputOverflow(f"more than {cap} bytes of output")
            if connection is io:
                kept[io].append(chunk)
    return b"".join(kept[io])


def _kill(pidfd: int) -> None:
    """Kill a call's process, the init of its pid namespace (so all in it), and see it
    dead.

    Raises:
        RuntimeError: it was still there after the kill (never seen).
    """
    with _quiet():
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    readable, _, _ = select.select([pidfd], [], [], KILL_WAIT_S)
    if not readable:
        raise RuntimeError("a call's process outlived its kill")


def _exit_status(pidfd: int) -> int:
    import fcntl

    deadline = time.monotonic() + REAP_WAIT_S
    while True:
        info = bytearray(PIDFD_INFO_SIZE)
        struct.pack_into("Q", info, 0, PIDFD_INFO_EXIT)
        try:
            fcntl.ioctl(pidfd, PIDFD_GET_INFO, info)
        except OSError as exc:
            # ESRCH: being reaped (gone, its status not kept yet). Else: a kernel without it.
            if exc.errno != errno.ESRCH:
                return UNKNOWN_STATUS
        else:
            if struct.unpack_from("Q", info, 0)[0] & PIDFD_INFO_EXIT:
                return int(struct.unpack_from("i", info, 60)[0])
        if time.monotonic() > deadline:
            return UNKNOWN_STATUS  # exited, never reaped
        time.sleep(REAP_POLL_S)  # exited, not reaped yet
