"""One call of a tool in fork mode: its process cloned from the tool's frozen template
(``_frozen``) when the call runs, fed, watched and ended as a sandbox's run is.

The call has a cgroup of its own (memory and process limits, joined before it runs
anything), fresh namespaces, and its stdio on two sockets the runner listens on in a
folder bound read-only into the template's sandbox, under names no one can list; a
connection is taken only from the call's own process (``SO_PEERCRED``). Its exit status
comes from its pidfd (``PIDFD_GET_INFO``): the call is bubblewrap's init's child, not
the runner's. A call past its timeout, output cap or CPU time is killed through its
pidfd (it is pid 1 of its own pid namespace, so everything in it goes too) and seen
dead before its outcome is told; its cgroup is removed after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import functools
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from sandboxes._streams import TailBuffer
from sandboxes.base import Limits, SandboxOutcome, StopReason
from sandboxes.events import EventSink, OutputBudget, StderrSplitter
from sandboxes.subprocess._cgroup import CgroupUnavailable
from sandboxes.subprocess._frozen_calls import Cloned
from sandboxes.subprocess._outcome import outcome
from sandboxes.subprocess._process import (
    LIMITS_POLL_MAX_S,
    LIMITS_POLL_S,
    Ending,
    ProcessResult,
    WholeLimits,
)
from sandboxes.subprocess._ptrace import TraceError

if TYPE_CHECKING:
    from sandboxes._deferred import DeferredTeardown
    from sandboxes.subprocess._cgroup import CallCgroup
    from sandboxes.subprocess._frozen import FrozenTemplate

# PIDFD_GET_INFO with PIDFD_INFO_EXIT (Linux 6.15): the wait status of a process that is
# not our child, told once its parent (bubblewrap's init) has reaped it, a moment after
# its pidfd says it exited.
PIDFD_GET_INFO, PIDFD_INFO_EXIT, PIDFD_INFO_SIZE = 0xC040FF0B, 1 << 3, 64
REAP_WAIT_S, REAP_POLL_S = 2.0, 0.0005
KILL_WAIT_S = 10.0
STDERR_TAIL_BYTES = 8192
CHUNK = 65536


def exit_status_known() -> bool:
    """Whether this kernel tells the exit status of a process through its pidfd."""
    pidfd = os.pidfd_open(os.getpid())
    try:
        info = bytearray(PIDFD_INFO_SIZE)
        struct.pack_into("Q", info, 0, PIDFD_INFO_EXIT)
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, info)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


class ForkedCall:
    """A call's sandbox in fork mode (a ``WarmSandbox``): nothing exists until ``run``."""

    def __init__(
        self, template: FrozenTemplate, limits: Limits, ended: Callable[[], None], teardowns: DeferredTeardown
    ) -> None:
        self._ended: Callable[[], None] | None = ended  # told once, when it is discarded
        self._template = template
        self._limits = limits
        self._teardowns = teardowns
        self._sink: EventSink | None = None
        self._group: CallCgroup | None = None
        self._pidfd: int | None = None

    def set_timeout(self, timeout_ms: int) -> None:
        self._limits = dataclasses.replace(self._limits, timeout_ms=timeout_ms)

    def stream_events(self, sink: EventSink) -> None:
        self._sink = sink

    async def run(self, payload: bytes) -> SandboxOutcome:
        started = time.monotonic()
        limits = self._limits
        cloning = self._template.clone()
        try:
            cloned = await asyncio.wrap_future(cloning)
        except asyncio.CancelledError:
            # The clone may be under way in the tracer's thread: what it made is killed
            # once it is over.
            cloning.add_done_callback(functools.partial(_kill_late, self._teardowns))
            raise
        except (TraceError, CgroupUnavailable) as exc:
            message = f"the call could not be forked: {exc}"
            return SandboxOutcome.never_ran(StopReason.SANDBOX_UNAVAILABLE, message)
        self._pidfd, self._group = cloned.pidfd, cloned.group
        with cloned.io, cloned.err:
            result = await self._exchange(cloned, payload)
        duration_ms = (time.monotonic() - started) * 1000
        token = os.urandom(8).hex()  # no exec guard's: a tool's "not found" is its own
        told = outcome(result, True, token, duration_ms, False, missing=(), cgroup=self._group, limits=limits)
        return dataclasses.replace(told, forked=True)

    async def _exchange(self, cloned: Cloned, payload: bytes) -> ProcessResult:
        limits = self._limits
        tail = TailBuffer(STDERR_TAIL_BYTES)
        budget = OutputBudget(limits.max_output_bytes)
        stderr = StderrSplitter(tail, self._sink, budget)
        stdout = bytearray()
        ending = Ending.EXITED
        try:
            async with asyncio.timeout(limits.timeout_ms / 1000):
                ending = await _first_ending(
                    _feed(cloned.io, payload),
                    _read_stdout(cloned.io, stdout, budget),
                    _read_stderr(cloned.err, stderr),
                    _watch_limits(self._group, limits.cpu_seconds),
                )
                if ending is Ending.EXITED:
                    await _exited(cloned.pidfd)
        except TimeoutError:
            ending = Ending.TIMEOUT
        finally:
            if ending is not Ending.EXITED:
                await _kill(cloned.pidfd)
        status = await _exit_status(cloned.pidfd) if ending is Ending.EXITED else None
        if status is not None and os.WIFSIGNALED(status):
            returncode: int | None = -os.WTERMSIG(status)
        else:
            returncode = os.WEXITSTATUS(status) if status is not None else None
        if ending is not Ending.EXITED:
            returncode = -signal.SIGKILL
        return ProcessResult(ending, returncode, bytes(stdout), tail.text())

    async def close(self) -> None:
        self.discard()

    def discard(self) -> None:
        """Kill what is left of the call and close its pidfd; its cgroup's removal (which
        waits for the last of its processes to be gone) is handed to the backend's
        teardown thread, off the call's path."""
        pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        group, self._group = self._group, None
        ended, self._ended = self._ended, None
        if group is not None or ended is not None:
            self._teardowns.submit(functools.partial(_remove, group, ended))


def _remove(group: CallCgroup | None, ended: Callable[[], None] | None) -> None:
    # The cgroup first: the next call's process, made once ``ended`` is told, then does
    # not wait on the kernel's cgroup locks behind this removal.
    try:
        if group is not None:
            group.remove()  # kills what is left in it first
    finally:
        if ended is not None:
            ended()


def _kill_late(teardowns: DeferredTeardown, cloning: Future[Cloned]) -> None:
    """A clone whose call was cancelled meanwhile, once it is over: its process, if it was
    made, killed."""
    if cloning.cancelled() or cloning.exception() is not None:
        return
    cloned = cloning.result()
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(cloned.pidfd, signal.SIGKILL)
    os.close(cloned.pidfd)
    cloned.io.close()
    cloned.err.close()
    # Off the tracer's thread (this one): the removal waits for the process to be gone.
    teardowns.submit(cloned.group.remove)


async def _first_ending(*steps: object) -> Ending:
    """Run the exchange's steps together until stdout and stderr have ended (then the
    tool has exited or closed them), or one says the run must end."""
    tasks = [asyncio.ensure_future(step) for step in steps]  # type: ignore[call-overload]
    readers = set(tasks[1:3])
    try:
        while readers:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                tasks.remove(task)
                readers.discard(task)
                ending = task.result()
                if ending is not None:
                    return ending  # type: ignore[no-any-return]
        return Ending.EXITED
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _feed(io: socket.socket, payload: bytes) -> None:
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(io, payload)
        io.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # a tool that never read its input, or closed it: as with a pipe
    await asyncio.Event().wait()  # fed: it waits for the others


async def _read_stdout(io: socket.socket, stdout: bytearray, budget: OutputBudget) -> Ending | None:
    loop = asyncio.get_running_loop()
    while chunk := await _received(loop, io):
        if not budget.take(len(chunk)):
            return Ending.OUTPUT_LIMIT
        stdout += chunk
    return None


async def _read_stderr(err: socket.socket, stderr: StderrSplitter) -> None:
    loop = asyncio.get_running_loop()
    while chunk := await _received(loop, err):
        stderr.feed(chunk)


async def _received(loop: asyncio.AbstractEventLoop, connection: socket.socket) -> bytes:
    """The next bytes; empty at the end. A reset is an end: the tool exited with input
    it never read (a pipe would have said EOF too)."""
    try:
        return await loop.sock_recv(connection, CHUNK)
    except ConnectionResetError:
        return b""


async def _watch_limits(group: CallCgroup | None, cpu_seconds: int) -> Ending | None:
    """The limits of all the call's processes together (``WholeLimits``), polled as a
    sandbox's are (``LIMITS_POLL_S`` doubling to ``LIMITS_POLL_MAX_S``): an OOM kill ends
    the call even while its parent goes on waiting (each process alone also meets its
    CPU-time rlimit)."""
    poll_every = LIMITS_POLL_S
    whole = WholeLimits(group, cpu_seconds) if group is not None else None
    while whole is not None:
        await asyncio.sleep(poll_every)
        poll_every = min(poll_every * 2, LIMITS_POLL_MAX_S)
        broken = whole.breached()
        if broken is not None:
            return broken
    await asyncio.Event().wait()
    return None


async def _exited(pidfd: int) -> None:
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(pidfd, lambda: None if gone.done() else gone.set_result(None))
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)


async def _kill(pidfd: int) -> None:
    """Kill a call's process (pid 1 of its pid namespace: everything in it goes) and see it
    dead.

    Raises:
        RuntimeError: it was still there after the kill (never seen).
    """
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    try:
        async with asyncio.timeout(KILL_WAIT_S):
            await _exited(pidfd)
    except TimeoutError:
        raise RuntimeError("a forked call's process outlived its kill") from None


async def _exit_status(pidfd: int) -> int | None:
    """The wait status, once bubblewrap's init has reaped the process (None: never
    reaped within ``REAP_WAIT_S``)."""
    deadline = time.monotonic() + REAP_WAIT_S
    while True:
        info = bytearray(PIDFD_INFO_SIZE)
        struct.pack_into("Q", info, 0, PIDFD_INFO_EXIT)
        try:
            fcntl.ioctl(pidfd, PIDFD_GET_INFO, info)
        except OSError as exc:
            if exc.errno != errno.ESRCH:  # ESRCH: being reaped, its status not kept yet
                return None
        else:
            if struct.unpack_from("Q", info, 0)[0] & PIDFD_INFO_EXIT:
                return int(struct.unpack_from("i", info, 60)[0])
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(REAP_POLL_S)
