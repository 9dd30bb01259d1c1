"""A frozen template: a tool imported once in its sandbox, then stopped for good, and each
call's process cloned from it, from outside, with ptrace (fork mode).

The template (``runner_fork.py`` of the helper's folder) imports the tool's modules, says
ready on its stdout and blocks in a read. From then on none of its code runs again: this
module seizes and interrupts it, checks it from outside (the only process in its sandbox,
one thread, still bubblewrap's namespaces, the runner's filter alone), blocks every
signal in it, and closes every descriptor it has and unmaps every shared mapping, by
system calls it makes it make. For each call it makes the template make one more: a
``clone`` into fresh user, mount, pid, IPC, network and UTS namespaces (the child a
sibling of the template, so bubblewrap's init reaps it). Before the child runs one
instruction of its own, it puts it in the call's cgroup, maps its uid, connects its
stdin and stdout to a socket of the runner's and its stderr to another, mounts a fresh
``/tmp``, ``/dev/shm``, ``/dev/pts`` and ``/proc``, sets its CPU-time rlimit and signal
mask, and drops every capability it has in its user namespace. Then the child returns
from the template's read, with nothing read, and runs the tool's script.

The template's seccomp filter is the sandbox's, except that ``mount`` and ``clone`` into
new namespaces go to the tracer instead of failing: made by this module (the only tracer
there ever is) they go through; made by the tool's code, untraced, they fail (ENOSYS).
Every ptrace request comes from the one thread that seized the template (``_trace``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import random
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandboxes._watchdog import forget_sandbox_init, parent_and_start, watch_sandbox_init
from sandboxes.subprocess._cgroup import CallCgroup, CgroupFactory
from sandboxes.subprocess._frozen_calls import accepted, join
from sandboxes.subprocess._frozen_checks import (
    TemplateRefused,
    capabilities,
    sandboxed,
    shared_mappings,
    status,
    untrustworthy,
)
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
    WALL,
    Injector,
    Regs,
    TraceError,
    regs_of,
    request,
    stop_of,
)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
FRESH = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
CLONE_PARENT, SIGCHLD = 0x8000, 17
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
SYS_READ, SYS_CLOSE, SYS_MUNMAP, SYS_DUP2, SYS_SOCKET, SYS_CONNECT = 0, 3, 11, 33, 41, 42
SYS_CHDIR = 80
SYS_IOCTL, SIOCSIFFLAGS, LOOPBACK_UP = 16, 0x8914, 0x1 | 0x8 | 0x40  # IFF_UP, IFF_LOOPBACK, IFF_RUNNING
SYS_CLONE, SYS_WRITE, SYS_CAPSET, SYS_MOUNT, SYS_OPENAT = 56, 1, 126, 165, 257
SYS_RT_SIGPROCMASK, SIG_SETMASK, SIGSET_BYTES = 14, 2, 8
SYS_PRLIMIT64, RLIMIT_CPU = 302, 0
AT_FDCWD, O_WRONLY = -100, 1
CAPABILITY_V3 = 0x20080522
MOUNTS = 5  # made in each call's process: /, /tmp, /dev/shm, /dev/pts, /proc
STOP_TRIES = 200  # about 10 ms apart: a template not found in its read by then is refused


@dataclass(frozen=True)
class CallSetUp:
    """What a call's process is given before it runs anything of its own."""

    cgroups: CgroupFactory  # its cgroup is made from it, with these limits
    memory_mb: int
    max_pids: int
    listeners: tuple[socket.socket, socket.socket]  # of its stdin and stdout, of its stderr
    addresses: tuple[str, str]  # where it connects to them, as the template sees them
    cpu_seconds: int
    disk_mb: int


@dataclass(frozen=True)
class Cloned:
    """A call's process, running: its host pid, a pidfd of it, and its sockets."""

    pid: int
    pidfd: int
    group: CallCgroup  # its cgroup: the caller's to remove
    io: socket.socket  # its stdin and stdout
    err: socket.socket  # its stderr


class FrozenTemplate:
    """One tool's frozen template in its sandbox; ``clone`` makes each call's process.

    ``argv`` starts the sandbox (bubblewrap, its descriptors in ``pass_fds``, the
    environment ``env``); ``inside`` is the uid and gid the tool runs as in it, and ``cwd``
    its working folder there. Blocks until the template is frozen.

    Raises:
        TemplateRefused: it did not say ready in ``ready_s``, or failed a check.
    """

    def __init__(
        self,
        argv: list[str],
        pass_fds: tuple[int, ...],
        env: dict[str, str],
        inside: tuple[int, str],
        ready_s: float,
    ) -> None:
        self._inside, self._cwd = inside
        self._closed = False  # no job is queued once it is (under ``_closing``)
        self._closing = threading.Lock()
        self._jobs: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = (
            queue.Queue()
        )
        self.process: subprocess.Popen[bytes] | None = None
        self._init: tuple[int, int] | None = None  # bubblewrap's init: pid, start time
        self._pidfd: int | None = None  # the template's: readable once it has died
        self._pidfd_lock = threading.Lock()  # ``ended`` never polls one closed (or reused)
        self._broken: str | None = None  # why no call can be cloned from it any more
        ready: Future[None] = Future()
        # bubblewrap dies with the thread that started it: this one, which lives as long
        # as the template.
        self._tracer = threading.Thread(
            target=self._trace,
            args=(argv, pass_fds, env, ready_s, ready),
            daemon=True,
            name="runner-fork-template",
        )
        self._tracer.start()
        try:
            ready.result()
        except BaseException:
            self.close()
            raise

    # -- the tracer's thread: every ptrace request comes from it ------------------------

    def _trace(
        self,
        argv: list[str],
        pass_fds: tuple[int, ...],
        env: dict[str, str],
        ready_s: float,
        ready: Future[None],
    ) -> None:
        try:
            try:
                self.process = subprocess.Popen(
                    argv, pass_fds=pass_fds, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            finally:
                for fd in pass_fds:
                    os.close(fd)
            self._template, self._base = self._freeze(ready_s)
        except BaseException as exc:
            if isinstance(exc, OSError):  # it exited, or did not stop as asked, while frozen
                exc = TemplateRefused(f"the tool's template could not be frozen: {exc}")
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while (job := self._jobs.get()) is not None:
                work, args, done = job
                # Cancelled while it waited (its call was): nothing is made. Once running it
                # can no longer be cancelled; its caller then cleans up what it made.
                if not done.set_running_or_notify_cancel():
                    continue
                try:
                    done.set_result(work(*args))
                except BaseException as exc:
                    done.set_exception(exc)
        finally:
            _kill_quietly(self._template)
            with self._closing:
                self._closed = True
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Fail every job still queued: the tracer is gone (no job is queued after this)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job[2].set_running_or_notify_cancel():
                job[2].set_exception(TemplateRefused("the tool's template is closed"))

    def _freeze(self, ready_s: float) -> tuple[int, Regs]:
        process = self.process
        assert process is not None and process.stdout is not None
        readable, _, _ = select.select([process.stdout], [], [], ready_s)
        if not readable or os.read(process.stdout.fileno(), 1) != b"r":
            raise TemplateRefused("the tool's template did not start (its imports failed or took too long)")
        init, template, _ = sandboxed(process.pid)
        self._init = (init, parent_and_start(init)[1])
        watch_sandbox_init(*self._init)  # should the runner die: its death takes them all
        # Seized with no event to trace yet: until it is frozen, the tool's own mount or
        # clone into new namespaces meets a tracer that does not take them (ENOSYS).
        request(SEIZE, template, 0, O_EXITKILL)
        self._pidfd = os.pidfd_open(template)
        # The tracer and the template on one CPU: the thirty-odd round trips of a call's
        # set-up then never wait for an idle core to wake up.
        self._cpus = os.sched_getaffinity(0)
        pinned = {random.choice(sorted(self._cpus))}  # noqa: S311 - spread, not secret
        os.sched_setaffinity(0, pinned)  # this thread only
        os.sched_setaffinity(template, pinned)
        base = self._stop_in_read(template)
        # Stopped for good: what is checked now cannot change any more.
        threads = list(Path(f"/proc/{template}/task").iterdir())
        if len(threads) != 1:
            raise TemplateRefused(f"the tool's imports left {len(threads)} threads in its template")
        if str(Path(f"/proc/{template}/cwd").readlink()) != self._cwd:  # a call would start there
            raise TemplateRefused(f"the tool's imports left its template outside {self._cwd}")
        if status(template, "Seccomp_filters") != "1" or status(template, "NoNewPrivs") != "1":
            raise TemplateRefused("the tool's imports loaded a system-call filter of their own")
        request(SETOPTIONS, template, 0, O_TRACEFORK | O_TRACECLONE | O_TRACESECCOMP | O_EXITKILL)
        try:
            frozen = Injector(template, base)
            # Every signal blocked: a pending one (a timer the import set goes on firing)
            # would make each call's clone fail. A call gets back the template's mask.
            self._mask = int(status(template, "SigBlk"), 16)
            everything = frozen.put(struct.pack("Q", (1 << 64) - 1))
            frozen.checked(SYS_RT_SIGPROCMASK, SIG_SETMASK, everything, 0, SIGSET_BYTES)
            frozen.close()
            for fd in Path(f"/proc/{template}/fd").iterdir():
                frozen.checked(SYS_CLOSE, int(fd.name))
            for low, high in shared_mappings(template):
                frozen.checked(SYS_MUNMAP, low, high - low)
        except TraceError as exc:
            raise TemplateRefused(f"the tool's template could not be frozen: {exc}") from exc
        problem = untrustworthy(init, template, sandboxed(process.pid))
        if problem:
            raise TemplateRefused(f"the tool's template is refused: {problem}")
        return template, base

    def _stop_in_read(self, template: int) -> Regs:
        """Stop the template in its read of stdin (its ready comes just before: it may
        not be there yet), from which each call's process returns."""
        where: collections.Counter[int] = collections.Counter()
        for _ in range(STOP_TRIES):
            request(INTERRUPT, template)
            event, _ = stop_of(template)
            while event != EVENT_STOP:
                # A signal on its way first: dropped, so its read goes on (delivered, its
                # handler would run and the stop would come in it).
                request(CONT, template)
                request(INTERRUPT, template)
                event, _ = stop_of(template)
            regs = regs_of(template)
            if regs.orig_rax == SYS_READ and regs.rdi == 0:
                return regs
            where[regs.orig_rax if regs.orig_rax < 1 << 63 else -1] += 1  # -1: not in a system call
            request(CONT, template)
            time.sleep(random.uniform(0.005, 0.015))  # noqa: S311  # never in step with a timer of the tool's
        raise TemplateRefused(f"the tool's template never waited in its read of stdin ({dict(where)})")

    def _clone(self, setup: CallSetUp) -> Cloned:
        """A call's process, cloned, set up and let go."""
        group = setup.cgroups.create(setup.memory_mb, setup.max_pids)
        try:
            template = Injector(self._template, self._base)
            template.checked(SYS_CLONE, FRESH | CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)
        except BaseException as exc:
            group.remove()
            self._broken = f"a call could not be cloned from it: {exc}"
            raise
        (child,) = template.children
        connections: list[socket.socket] = []
        try:
            return self._set_up(child, group, setup, connections)
        except BaseException:
            _kill_quietly(child)
            with contextlib.suppress(OSError):
                os.waitpid(child, WALL)  # traced: it is ours to reap first
            for connection in connections:
                connection.close()
            group.remove()
            raise

    def _set_up(
        self, child: int, group: CallCgroup, setup: CallSetUp, connections: list[socket.socket]
    ) -> Cloned:
        if stop_of(child)[0] != EVENT_STOP:
            raise TraceError(0, f"the call's process {child} did not stop at its start")
        call = Injector(child, self._base)
        inside = self._inside
        for name, line in (
            ("uid_map", f"{inside} {inside} 1"),
            ("setgroups", "deny"),
            ("gid_map", f"{inside} {inside} 1"),
        ):
            fd = call.checked(SYS_OPENAT, AT_FDCWD, call.text(f"/proc/self/{name}"), O_WRONLY)
            call.checked(SYS_WRITE, fd, call.text(line), len(line))
            call.checked(SYS_CLOSE, fd)
        for listener, address_of, numbers in zip(
            setup.listeners, setup.addresses, ((0, 1), (2,)), strict=True
        ):
            sock = call.checked(SYS_SOCKET, socket.AF_UNIX, socket.SOCK_STREAM, 0)
            address = struct.pack("H", socket.AF_UNIX) + address_of.encode() + b"\0"
            call.checked(SYS_CONNECT, sock, call.put(address), len(address))  # before /run is covered
            for number in numbers:
                if sock != number:
                    call.checked(SYS_DUP2, sock, number)
            if sock not in numbers:
                call.checked(SYS_CLOSE, sock)
            connections.append(accepted(listener, child))
        join(call, connections[0], group.join_files)  # before it runs anything
        call.checked(SYS_MOUNT, call.text("none"), call.text("/"), 0, MS_REC | MS_PRIVATE, 0)
        tmpfs, options = call.text("tmpfs"), call.text(f"size={setup.disk_mb}m,mode=1777")
        for target in ("/tmp", "/dev/shm"):  # noqa: S108 - the call's own
            call.checked(SYS_MOUNT, tmpfs, call.text(target), tmpfs, MS_NOSUID | MS_NODEV, options)
        devpts, pts = call.text("devpts"), call.text("newinstance,ptmxmode=0666,mode=0620")
        call.checked(SYS_MOUNT, devpts, call.text("/dev/pts"), devpts, MS_NOSUID | MS_NOEXEC, pts)
        proc = call.text("proc")  # its own pid namespace's: only itself
        call.checked(SYS_MOUNT, proc, call.text("/proc"), proc, MS_NOSUID | MS_NODEV | MS_NOEXEC, 0)
        call.checked(SYS_CHDIR, call.text(self._cwd))  # whatever the import left, checked below
        # Its own network: loopback only, up (as bubblewrap's is), for a tool that talks to itself.
        inet = call.checked(SYS_SOCKET, socket.AF_INET, socket.SOCK_DGRAM, 0)
        call.checked(SYS_IOCTL, inet, SIOCSIFFLAGS, call.put(struct.pack("16sH22x", b"lo", LOOPBACK_UP)))
        call.checked(SYS_CLOSE, inet)
        limit = call.put(struct.pack("QQ", setup.cpu_seconds, setup.cpu_seconds + 1))  # SIGXCPU, then SIGKILL
        call.checked(SYS_PRLIMIT64, 0, RLIMIT_CPU, limit, 0)
        mask = call.put(struct.pack("Q", self._mask))
        call.checked(SYS_RT_SIGPROCMASK, SIG_SETMASK, mask, 0, SIGSET_BYTES)
        header = call.put(struct.pack("Ii", CAPABILITY_V3, 0))
        call.checked(SYS_CAPSET, header, call.put(bytes(24)))  # nothing, in its user namespace
        # Checked from outside: each mount went through the tracer (a filter of the tool's
        # own could fake them; ``_freeze`` refuses one), and no capability is left.
        if (
            call.approved != MOUNTS
            or capabilities(child) != 0
            or str(Path(f"/proc/{child}/cwd").readlink()) != self._cwd
        ):
            raise TraceError(0, f"the call's process {child} was not set up as asked")
        pidfd = os.pidfd_open(child)
        try:
            os.sched_setaffinity(child, self._cpus)  # the call runs on any
            call.close(result=0)  # it returns from the template's read, with nothing read
            request(DETACH, child)
        except BaseException:
            os.close(pidfd)
            raise
        return Cloned(child, pidfd, group, *connections)

    # -- any thread ---------------------------------------------------------------------

    def clone(self, setup: CallSetUp) -> Future[Cloned]:
        """A call's process, set up as ``setup`` says and running the tool's script, when
        the future is done.

        The future's error: ``TraceError`` (the call could not be set up; the template
        may be unusable: ``ended``), or ``TemplateRefused`` once the template is closed."""
        done: Future[Cloned] = Future()
        with self._closing:
            if not self._closed:
                self._jobs.put((self._clone, (setup,), done))
                return done
        done.set_exception(TemplateRefused("the tool's template is closed"))
        return done

    def ended(self) -> str | None:
        """None while the template can serve calls; else why not."""
        process = self.process
        if process is None or process.poll() is not None:
            return "the tool's sandbox exited"
        with self._pidfd_lock:
            if self._pidfd is None or select.select([self._pidfd], [], [], 0)[0]:
                return "the tool's template died"
        if not self._tracer.is_alive():
            return "the tool's template is closed"
        return self._broken

    def close(self) -> None:
        """Kill the template's sandbox, and every call still in it (blocking)."""
        with self._closing:
            self._closed = True
            self._jobs.put(None)
        self._tracer.join(10)
        process = self.process
        try:
            if process is not None:
                _kill_quietly(process.pid)
                process.wait(timeout=10)
        finally:
            self._forget()

    def _forget(self) -> None:
        process = self.process
        if process is not None:
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()
        if self._init is not None:
            forget_sandbox_init(*self._init)
            self._init = None
        with self._pidfd_lock:
            pidfd, self._pidfd = self._pidfd, None
            if pidfd is not None:
                os.close(pidfd)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
