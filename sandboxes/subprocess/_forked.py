"""One call of a tool in fork mode: its process cloned from the tool's frozen template
(``_frozen``) when the call runs, then run by ``_process.drive`` as a sandbox's is.

The call has a cgroup of its own (memory and process limits, joined before it runs
anything), fresh namespaces, and its stdin, stdout and stderr on three sockets the
runner listens on in a folder bound read-only into the template's sandbox, under names
no one can list; a connection is taken only from the call's own process
(``SO_PEERCRED``). Its exit status comes from its pidfd (``PIDFD_GET_INFO``): the call
is bubblewrap's init's child, not the runner's. A call past its timeout, output cap or
CPU time is killed through its pidfd (it is pid 1 of its own pid namespace, so
everything in it goes too); ``drive`` waits a bounded time to see it gone, and its
cgroup's removal after the call waits for that in any case.
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

from sandboxes._exchange import PayloadExchange
from sandboxes.base import Limits, SandboxOutcome, StopReason
from sandboxes.events import EventSink
from sandboxes.subprocess._attach import UNKNOWN_STATUS, Transports
from sandboxes.subprocess._cgroup import CgroupUnavailable
from sandboxes.subprocess._frozen_calls import Cloned
from sandboxes.subprocess._outcome import outcome
from sandboxes.subprocess._process import WholeLimits, drive
from sandboxes.subprocess._ptrace import TraceError
from sandboxes.view import READ_CHUNK

if TYPE_CHECKING:
    from sandboxes._deferred import DeferredTeardown
    from sandboxes.subprocess._cgroup import CallCgroup
    from sandboxes.subprocess._frozen import FrozenTemplate

# PIDFD_GET_INFO with PIDFD_INFO_EXIT (Linux 6.15): the wait status of a process that is
# not our child, told once its parent (bubblewrap's init) has reaped it, a moment after
# its pidfd says it exited.
PIDFD_GET_INFO, PIDFD_INFO_EXIT, PIDFD_INFO_SIZE = 0xC040FF0B, 1 << 3, 64
REAP_WAIT_S, REAP_POLL_S = 2.0, 0.0005


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
        exchange = PayloadExchange(payload, limits.max_output_bytes, self._sink)
        process = await _ForkedProcess.attach(cloned)
        result = await drive(
            process,
            exchange,
            b"",
            limits.timeout_ms / 1000,
            process.kill,
            WholeLimits(cloned.group, limits.cpu_seconds).breached,
        )
        duration_ms = (time.monotonic() - started) * 1000
        token = os.urandom(8).hex()  # no exec guard's: a tool's "not found" is its own
        told = outcome(result, True, token, duration_ms, False, missing=(), cgroup=self._group, limits=limits)
        return dataclasses.replace(told, forked=True)

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
    cloned.close_sockets()
    # Off the tracer's thread (this one): the removal waits for the process to be gone.
    teardowns.submit(cloned.group.remove)


class _ForkedProcess:
    """A forked call's process as ``drive`` runs it (``_process.Driven``): its sockets
    as streams, its exit through its pidfd."""

    def __init__(self, cloned: Cloned) -> None:
        self._pidfd = cloned.pidfd
        self.returncode: int | None = None
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._transport = Transports()
        self._unused: list[asyncio.StreamWriter] = []

    @classmethod
    async def attach(cls, cloned: Cloned) -> _ForkedProcess:
        process = cls(cloned)
        try:
            # Each one way, as a pipe: the tool's writes to its stdin fail (EPIPE), and
            # nothing is ever sent to its stdout or stderr (so no reset can come back).
            cloned.stdin.shutdown(socket.SHUT_RD)
            _, process.stdin = await asyncio.open_connection(sock=cloned.stdin)
            process._transport.add(process.stdin.transport)
            for sock, name in ((cloned.stdout, "stdout"), (cloned.stderr, "stderr")):
                sock.shutdown(socket.SHUT_WR)
                reader, writer = await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
                process._transport.add(writer.transport)
                process._unused.append(writer)  # kept until its transport is closed with the others
                setattr(process, name, reader)
        except BaseException:
            process._transport.close()
            cloned.close_sockets()
            raise
        return process

    async def wait(self) -> int:
        await _exited(self._pidfd)
        status = await _exit_status(self._pidfd)
        if status is None:  # never reaped in time: a failure, never a success
            self.returncode = UNKNOWN_STATUS
        elif os.WIFSIGNALED(status):
            self.returncode = -os.WTERMSIG(status)
        else:
            self.returncode = os.WEXITSTATUS(status)
        return self.returncode

    def kill(self) -> None:
        """Kill it (pid 1 of its pid namespace: everything in it goes)."""
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


async def _exited(pidfd: int) -> None:
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(pidfd, lambda: None if gone.done() else gone.set_result(None))
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)


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
