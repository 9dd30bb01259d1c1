"""A process started ahead of its call, attached to the call's event loop.

A warm sandbox is started by ``subprocess.Popen`` in the pool's thread, on no event
loop: the loop that will serve its call does not exist yet (a synchronous
``Runner.call`` runs each call on a fresh one); a cold one is started the same way by
its call. When the call runs it, its pipes become the loop's streams and its exit is
watched through a pidfd (or, where ``pidfd_open`` is refused, by a thread waiting for
the exit without reaping), so ``_process.drive`` runs it exactly as a process asyncio
started itself. The runner reaps it itself: a status it cannot get (another waiter
reaped it) is ``UNKNOWN_STATUS``, a failure, never a success.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
from typing import IO

from sandboxes.view import READ_CHUNK

# The exit status of a process reaped by someone else: what asyncio reports then too.
UNKNOWN_STATUS = 255


class Transports:
    """The transports of a process's three streams, closed together (``drive``'s last
    step): pipes, or a forked call's sockets."""

    def __init__(self) -> None:
        self._transports: list[asyncio.BaseTransport] = []

    def add(self, transport: asyncio.BaseTransport) -> None:
        self._transports.append(transport)

    def close(self) -> None:
        close_transports(self._transports)


def close_transports(transports: list[asyncio.BaseTransport]) -> None:
    """Close the pipes of a run that is over (safe to call twice). A write pipe with input
    left is aborted: closed, it would stay open until that input drained (a tool that never
    read it), past the run's loop."""
    for transport in transports:
        if isinstance(transport, asyncio.WriteTransport) and transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()


class AttachedProcess:
    """What ``drive`` needs of a process: its streams, ``wait``, ``kill`` and ``returncode``."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self._loop = loop
        self.pid = popen.pid
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._transport = Transports()  # the name ``drive`` closes at its end
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        try:
            # Readable from the moment the process ends (at once if it already has).
            self._pidfd = os.pidfd_open(popen.pid)
        except OSError:  # refused (a kernel before 5.3, a seccomp profile): a thread waits
            threading.Thread(target=self._await_exit, name="runner-exit-waiter", daemon=True).start()
        else:
            loop.add_reader(self._pidfd, self._readable)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self._popen.returncode is None:
            self._popen.kill()

    def detach(self) -> None:
        """Stop watching on this loop and close the pipes: the run is over, its loop may
        close. A process not yet reaped is reaped by the sandbox's teardown."""
        self._stop_watching()
        self._transport.close()

    def _await_exit(self) -> None:
        """Wait (in a thread of its own) until the process has exited, leaving it to be
        reaped on the loop. Ends with the process, which the sandbox's teardown kills."""
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run is over
            self._loop.call_soon_threadsafe(self._readable)

    def _readable(self) -> None:
        returncode = self._reap()
        if returncode is not None:
            self._stop_watching()
            if not self._exited.done():
                self._exited.set_result(returncode)

    def _reap(self) -> int | None:
        """The exit status, reaping the process; None while it runs. Not ``Popen.poll``,
        which reads "reaped by someone else" (a process that ignores SIGCHLD has its
        children reaped by the kernel) as a clean exit 0."""
        if self._popen.returncode is not None:
            return self._popen.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            returncode = UNKNOWN_STATUS
        else:
            if pid == 0:
                return None
            returncode = os.waitstatus_to_exitcode(status)
        self._popen.returncode = returncode
        return returncode

    def _stop_watching(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


async def attach(popen: subprocess.Popen[bytes]) -> AttachedProcess:
    """Make ``popen`` (started with three pipes) drivable on the running loop; its
    ``detach`` must be called once the run is over, however it ended.

    Raises:
        OSError: the pidfd or a pipe could not be set up.
    """
    loop = asyncio.get_running_loop()
    assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
    proc = AttachedProcess(popen, loop)
    try:
        proc.stdout, out_transport = await _reader(loop, popen.stdout)
        proc._transport.add(out_transport)
        proc.stderr, err_transport = await _reader(loop, popen.stderr)
        proc._transport.add(err_transport)
        in_transport, in_protocol = await loop.connect_write_pipe(_WriteProtocol, popen.stdin)
        proc._transport.add(in_transport)
        proc.stdin = asyncio.StreamWriter(in_transport, in_protocol, None, loop)
    except BaseException:
        proc.detach()
        raise
    return proc


async def _reader(
    loop: asyncio.AbstractEventLoop, pipe: IO[bytes]
) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    reader = asyncio.StreamReader(limit=READ_CHUNK, loop=loop)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    return reader, transport


class _WriteProtocol(asyncio.streams.FlowControlMixin):
    """The write side's protocol: flow control for ``drain``, as asyncio's own pipes have."""

    def __init__(self) -> None:
        super().__init__()
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        return self._closed

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self._closed.done():
            self._closed.set_result(None)
