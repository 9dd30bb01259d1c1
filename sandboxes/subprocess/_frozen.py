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
stdin, stdout and stderr each to a socket of the runner's, gives it a cgroup namespace
rooted at that cgroup, mounts a fresh ``/tmp``, ``/dev/shm``, ``/dev/pts`` and
``/proc``, sets its CPU-time rlimit and signal mask, and drops every capability it has
in its user namespace. Then the child returns from the template's read, with nothing
read, and runs the tool's script. Once asked (``spare``), the next call's child is made
ahead and held, stopped before its first instruction, so that a call only lets its
child go.

The template's seccomp filter is the sandbox's, except that ``mount``, ``unshare`` and
``clone`` into new namespaces go to the tracer instead of failing: made by this module
(the only tracer there ever is) they go through; made by the tool's code, untraced,
they fail (ENOSYS).
Every ptrace request comes from the one thread that seized the template (``_trace``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sandboxes._kernel import ready
from sandboxes._watchdog import forget_sandbox_init, parent_and_start, watch_sandbox_init
from sandboxes.subprocess._frozen_calls import (
    CallSetUp,
    Cloned,
    Inside,
    close_listeners,
    listening,
    reaches_init,
    reap_quietly,
    set_up,
    signalled,
)
from sandboxes.subprocess._frozen_checks import (
    TemplateRefused,
    exited,
    sandboxed,
    seize_alive,
    shared_mappings,
    status,
    untrustworthy,
)
from sandboxes.subprocess._ptrace import (
    DETACH,
    O_EXITKILL,
    O_TRACECLONE,
    O_TRACEFORK,
    O_TRACESECCOMP,
    SETOPTIONS,
    Injector,
    Regs,
    TraceError,
    regs_of,
    request,
    stop_in_read,
)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
FRESH = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
CLONE_PARENT, SIGCHLD = 0x8000, 17
SYS_CLOSE, SYS_MUNMAP, SYS_CLONE = 3, 11, 56
SYS_RT_SIGPROCMASK, SIG_SETMASK, SIGSET_BYTES = 14, 2, 8
STOP_TRIES = 200  # about 10 ms apart: a template not found in its read by then is refused
STOP_POLL_S = 0.05  # how often the waits for a template look whether the runner is closing
FREEZE_S = 10.0  # for the freeze, once the template has said ready
NOT_IN_A_SYSCALL = (1 << 64) - 1  # ``orig_rax`` of a process stopped outside a system call


class FrozenTemplate:
    """One tool's frozen template in its sandbox; ``clone`` makes each call's process.

    ``argv`` starts the sandbox (bubblewrap, its descriptors in ``pass_fds``, the
    environment ``env``); ``inside`` is the uid and gid the tool runs as in it, and its
    working folder there; ``setup`` what each call's process is given. Blocks until the
    template is frozen: ``ready`` bounds its imports in seconds, and the event in it,
    once set, ends them. One call's process is kept made ahead once ``spare`` is asked.

    Raises:
        TemplateRefused: it did not say ready in time, the event was set, or it failed a
            check.
    """

    def __init__(
        self,
        argv: list[str],
        pass_fds: tuple[int, ...],
        env: dict[str, str],
        inside: tuple[int, str],
        ready: tuple[float, threading.Event],
        setup: CallSetUp,
    ) -> None:
        self._uid, self._cwd = inside
        self._setup = setup
        self._spare: Cloned | None = None  # the tracer's alone
        self._spare_queued = False
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
        frozen: Future[None] = Future()
        # bubblewrap dies with the thread that started it: this one, which lives as long
        # as the template.
        self._tracer = threading.Thread(
            target=self._trace,
            args=(argv, pass_fds, env, ready, frozen),
            daemon=True,
            name="runner-fork-template",
        )
        self._tracer.start()
        try:
            self._wait_frozen(frozen, *ready)
        except BaseException:
            self.close()
            raise

    def _wait_frozen(self, frozen: Future[None], ready_s: float, stop: threading.Event) -> None:
        """Wait for the tracer to freeze the template. Its sandbox is killed, and the
        template refused, once the runner closes or the freeze outlasts its bound: an
        import that has said ready can leave the template where the tracer's own waits
        never end (in a ``vfork``, a lingering ``close``), which only a kill ends."""
        deadline = time.monotonic() + ready_s + FREEZE_S
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                return frozen.result(timeout=STOP_POLL_S)
        self._kill_sandbox()
        with contextlib.suppress(Exception):
            frozen.result(timeout=FREEZE_S)  # the tracer's waits end with the template
        if stop.is_set():
            raise TemplateRefused("the tool's template was given up: the runner is closing")
        raise TemplateRefused(f"the tool's template was not frozen within {ready_s + FREEZE_S:.0f} s")

    # -- the tracer's thread: every ptrace request comes from it ------------------------

    def _trace(
        self,
        argv: list[str],
        pass_fds: tuple[int, ...],
        env: dict[str, str],
        ready: tuple[float, threading.Event],
        frozen: Future[None],
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
            self._template, self._base = self._freeze(*ready)
            self._inside = Inside(self._uid, self._cwd, self._mask)
        except BaseException as exc:
            if isinstance(exc, OSError):  # it exited, or did not stop as asked, while frozen
                exc = TemplateRefused(f"the tool's template could not be frozen: {exc}")
            self._kill_template()  # seized without EXITKILL: not killed by this thread's end
            frozen.set_exception(exc)
            return
        frozen.set_result(None)
        try:
            while (job := self._jobs.get()) is not None:
                work, args, done = job
                # Cancelled while it waited (its call was): nothing is made. Once running it
                # can no longer be cancelled; its caller then cleans up what it made.
                if not done.set_running_or_notify_cancel():
                    continue
                if self._closed:  # asked before the close: refused, not made and killed
                    done.set_exception(TemplateRefused("the tool's template is closed"))
                    continue
                try:
                    done.set_result(work(*args))
                except BaseException as exc:
                    done.set_exception(exc)
        finally:
            spare, self._spare = self._spare, None
            with contextlib.suppress(Exception):  # the template and the queue come first
                if spare is not None:
                    spare.drop()
            self._kill_template()
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

    def _freeze(self, ready_s: float, stop: threading.Event) -> tuple[int, Regs]:
        process = self.process
        assert process is not None and process.stdout is not None
        deadline = time.monotonic() + ready_s
        readable: list[int] = []
        while not readable and (left := deadline - time.monotonic()) > 0:
            if stop.is_set():  # the runner is closing: its close waits for no import
                raise TemplateRefused("the tool's template was given up while it imported")
            readable = ready([process.stdout.fileno()], min(left, STOP_POLL_S))
        if not readable or os.read(process.stdout.fileno(), 1) != b"r":
            raise TemplateRefused("the tool's template did not start (its imports failed or took too long)")
        init, template, _ = sandboxed(process.pid)
        self._init = (init, parent_and_start(init)[1])
        watch_sandbox_init(*self._init)  # should the runner die: its death takes them all
        self._pidfd = seize_alive(init, template)
        # The tracer and the template on one CPU: the thirty-odd round trips of a call's
        # set-up then never wait for an idle core to wake up.
        self._cpus = os.sched_getaffinity(0)
        pinned = {random.choice(sorted(self._cpus))}  # noqa: S311 - spread, not secret
        os.sched_setaffinity(0, pinned)  # this thread only
        os.sched_setaffinity(template, pinned)
        try:  # in its read of stdin (its ready comes just before: it may not be there yet)
            base = stop_in_read(template, 0, STOP_TRIES)
        except TraceError as exc:
            raise TemplateRefused(f"the tool's template could not be stopped: {exc}") from exc
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
            if reaches_init(frozen):
                raise TemplateRefused("the tool's template can reach its sandbox's init")
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

    def _clone(self) -> Cloned:
        """A call's process, let go: the spare, or one made now."""
        spare, self._spare = self._spare, None
        if spare is not None:
            try:
                if not signalled(spare.pid):
                    return self._let_go(spare)
            except OSError:  # a ``TraceError`` too: killed meanwhile (by root)
                pass
            spare.drop()  # made afresh
        made = self._make()
        try:
            return self._let_go(made)
        except BaseException as exc:
            made.drop()
            if isinstance(exc, TraceError):  # every call's would fail so: warm or cold instead
                self._broken = f"a call's process could not be let go: {exc}"
            raise

    def _make_spare(self) -> None:
        self._spare_queued = False
        if self._spare is None and not self._closed and self._broken is None:
            try:
                self._spare = self._make()
            except TraceError as exc:
                # The set-up failed its checks or a system call: said as the template's
                # end (the operator log, the audit), the tool served warm or cold until a
                # new template is ready.
                self._broken = f"the next call's process could not be set up: {exc}"
            except OSError:
                pass  # out of descriptors, a cgroup refused: the next call tries, and says it

    def _make(self) -> Cloned:
        """A call's process, cloned and set up, stopped before its first instruction."""
        setup = self._setup
        listened = listening(setup)
        try:
            group = setup.cgroups.create(setup.memory_mb, setup.max_pids)
            try:
                template = Injector(self._template, self._base)
                template.checked(SYS_CLONE, FRESH | CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)
                if len(template.children) != 1:
                    raise TraceError(0, f"the clone made {len(template.children)} processes")
                (child,) = template.children
            except BaseException as exc:
                group.remove()
                self._broken = f"a call could not be cloned from it: {exc}"
                raise
            connections: list[socket.socket] = []
            try:
                pidfd = os.pidfd_open(child)  # held by us, traced: it cannot be reaped yet
            except BaseException:
                _kill_quietly(child)
                group.remove()
                raise
            try:
                set_up(child, self._base, group, setup, self._inside, listened, connections)
            except BaseException:
                # Through its pidfd: a child that died in its set-up went back to its parent,
                # which may have reaped it, its pid free for another process.
                reap_quietly(pidfd)
                for connection in connections:
                    connection.close()
                group.remove()
                raise
            return Cloned(child, pidfd, group, *connections)
        finally:
            close_listeners(listened[0])  # taken: no one else may connect

    def _let_go(self, cloned: Cloned) -> Cloned:
        # Where its set-up left it, returning from the template's read, and in no system
        # call: let go from anywhere else (a seccomp stop), it would go on from there.
        regs = regs_of(cloned.pid)
        if (regs.rip, regs.rax, regs.orig_rax) != (self._base.rip, 0, NOT_IN_A_SYSCALL):
            raise TraceError(0, f"the call's process {cloned.pid} is not where its set-up left it")
        os.sched_setaffinity(cloned.pid, self._cpus)  # the call runs on any
        request(DETACH, cloned.pid)
        return cloned

    # -- any thread ---------------------------------------------------------------------

    def clone(self) -> Future[Cloned]:
        """A call's process, set up and running the tool's script, when the future is done.

        The future's error: ``TraceError`` (the call could not be set up; the template
        may be unusable: ``ended``), or ``TemplateRefused`` once the template is closed."""
        done: Future[Cloned] = Future()
        with self._closing:
            if not self._closed:
                self._jobs.put((self._clone, (), done))
                return done
        done.set_exception(TemplateRefused("the tool's template is closed"))
        return done

    def spare(self) -> None:
        """Have the next call's process made ahead, set up and held stopped (if none is):
        that call then only lets it go. Made from the template like any call's, before
        the call exists; a failure shows in ``ended``."""
        with self._closing:
            if self._closed or self._spare_queued:
                return
            self._spare_queued = True
            self._jobs.put((self._make_spare, (), Future()))

    def ended(self) -> str | None:
        """None while the template can serve calls; else why not."""
        process = self.process
        if process is None or process.poll() is not None:
            return "the tool's sandbox exited"
        with self._pidfd_lock:
            if self._pidfd is None or exited(self._pidfd):
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
                self._kill_sandbox()
                process.wait(timeout=10)
        finally:
            self._forget()

    def _kill_sandbox(self) -> None:
        """Kill bubblewrap: its init, the template and every call go with it."""
        process = self.process
        if process is not None:
            with contextlib.suppress(OSError):
                process.kill()  # ``Popen``'s: never a pid it has reaped (a second close)
        self._kill_template()  # should bubblewrap's init outlive it

    def _kill_template(self) -> None:
        """Through its pidfd: the template may be gone, its pid reused."""
        with self._pidfd_lock:
            if self._pidfd is not None:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

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
