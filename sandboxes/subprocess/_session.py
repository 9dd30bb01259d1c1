"""A subprocess session sandbox: one hardened sandbox whose agent
(``_session_agent``) runs the tool again for each call of its session.

The sandbox is prepared and started as a warm one is (``PreparedSubprocess``), with the
agent as its program; it is never run as a whole. Each call gets three fresh pipes,
handed to the agent over the control socket, and is driven by ``_process.drive`` as any
run is (its timeout, output cap, the CPU and memory of the whole cgroup). A call that does
not end by its own exit ends the session: the cgroup is killed, agent and all.

As a warm pool does, the next call's process is started ahead, as soon as the sandbox is
ready and again when a call has ended: its exec guard's token goes in at once, so the
tool starts up and waits on its stdin for its payload, and the next call begins there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import os
import socket
import time
from typing import TYPE_CHECKING

from sandboxes._exchange import PayloadExchange
from sandboxes._exec_status import new_token, token_line
from sandboxes.base import (
    LaunchSpec,
    Limits,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
    WorkspaceNotApplied,
)
from sandboxes.cancellation import finish_shielded
from sandboxes.events import EventSink
from sandboxes.session import BetweenCalls, SessionEnd
from sandboxes.subprocess._attach import _reader, _WriteProtocol, close_transports
from sandboxes.subprocess._outcome import outcome
from sandboxes.subprocess._process import Ending, drive
from sandboxes.subprocess._session_agent import AGENT_MESSAGE_BYTES, AGENT_PYTHON, READY, RUN, agent_command

if TYPE_CHECKING:
    from sandboxes.subprocess._prepared import PreparedSubprocess
    from sandboxes.subprocess.sandbox import SubprocessSandbox

# How long the agent may take to start (bubblewrap, then Python) before the session is
# refused; a loaded machine may take seconds.
READY_TIMEOUT_S = 15.0
# The launcher's own descriptor 3 is the "started" pipe: the control socket stays above.
FIRST_CONTROL_FD = 10
# Outcomes that mean the runner killed the call, or that a limit of the whole session broke.
_ENDS_SESSION = frozenset(
    {
        StopReason.TIMEOUT,
        StopReason.OUTPUT_LIMIT,
        StopReason.MEMORY_LIMIT,
        StopReason.CPU_LIMIT,
        StopReason.PIDS_LIMIT,
    }
)


async def open_session(owner: SubprocessSandbox, spec: LaunchSpec, limits: Limits) -> SubprocessSession:
    """Prepare and start a session sandbox for ``spec`` (``HoldsSessions.open_session``).

    Raises:
        SandboxUnavailable: as ``prepare``; or the agent could not start.
    """
    if spec.egress is not None:
        raise SandboxUnavailable("a session sandbox cannot use the egress proxy, which lives for one call")
    if not os.access(AGENT_PYTHON, os.X_OK):
        raise SandboxUnavailable(f"a session sandbox needs {AGENT_PYTHON}")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        theirs_fd = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, FIRST_CONTROL_FD)
    finally:
        theirs.close()
    agent_spec = dataclasses.replace(spec, command=agent_command(theirs_fd, spec.command))
    try:
        prepared = await owner.prepare(agent_spec, limits)
    except BaseException:
        ours.close()
        os.close(theirs_fd)
        raise
    session = SubprocessSession(prepared, ours, limits)
    prepared._command.inherited = (theirs_fd,)  # the launch closes it here
    try:
        await finish_shielded(asyncio.to_thread(prepared.start_waiting))
        await session.wait_ready()
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(theirs_fd)  # still ours if the launch never came
        with contextlib.suppress(WorkspaceNotApplied):  # what failed the opening is what is said
            await finish_shielded(session.close())
        raise
    return session


class SubprocessSession:
    """``SessionSandbox`` of the subprocess backend."""

    def __init__(self, prepared: PreparedSubprocess, control: socket.socket, limits: Limits) -> None:
        self._prepared = prepared
        self._control = control
        control.setblocking(False)
        self._limits = limits
        self._end: SessionEnd | None = None
        self._busy = False
        self._ahead: _Started | None = None  # the next call's process, started ahead
        self._between = BetweenCalls()

    async def wait_ready(self) -> None:
        """Wait for the agent's first word.

        Raises:
            SandboxUnavailable: it did not come.
        """
        loop = asyncio.get_running_loop()
        try:
            word = await asyncio.wait_for(loop.sock_recv(self._control, AGENT_MESSAGE_BYTES), READY_TIMEOUT_S)
        except (TimeoutError, OSError):
            word = b""
        if word != READY:
            self._end = SessionEnd.DIED
            raise SandboxUnavailable("the session sandbox could not be started")
        self._ahead = self._start_call()

    def ended(self) -> SessionEnd | None:
        """How the sandbox ended, if it did; between calls, a limit of the sandbox as a
        whole that it passed ends it here (a process a call left behind may keep using
        CPU or memory, and no call's poll looks then)."""
        if self._end is None and not self._busy and self._prepared.ended() is not None:
            self._end = SessionEnd.DIED  # killed from outside, or by a process a call left
        if self._end is None and not self._busy and self._between.due() and self._prepared.limit_broken():
            self.kill(SessionEnd.LIMIT)
        return self._end

    async def run(self, payload: bytes, timeout_ms: int, events: EventSink | None = None) -> SandboxOutcome:
        if self._end is not None:
            raise SandboxUnavailable(f"the session sandbox has ended ({self._end.value})")
        if self._busy:
            raise SandboxUnavailable("a session sandbox serves one call at a time")
        self._busy = True
        try:
            return await self._call(payload, dataclasses.replace(self._limits, timeout_ms=timeout_ms), events)
        finally:
            self._busy = False

    def _start_call(self) -> _Started:
        """Have the agent start the tool once more, its token written: it starts up and
        waits for its payload.

        Raises:
            SandboxUnavailable: the agent is gone.
        """
        in_read, in_write = os.pipe()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        token = new_token()
        os.write(in_write, token_line(token))  # one line, far below PIPE_BUF: never blocks
        try:
            socket.send_fds(self._control, [RUN], [in_read, out_write, err_write])
        except OSError as exc:
            for fd in (in_write, out_read, err_read):
                os.close(fd)
            self._end = SessionEnd.DIED
            raise SandboxUnavailable("the session sandbox is gone") from exc
        finally:
            for fd in (in_read, out_write, err_write):
                os.close(fd)
        return _Started(token, in_write, out_read, err_read)

    async def _call(self, payload: bytes, limits: Limits, events: EventSink | None) -> SandboxOutcome:
        call, self._ahead = self._ahead or self._start_call(), None
        started = time.monotonic()
        proc = _CallProcess(self)
        try:
            try:
                await proc.attach(call.stdin, call.stdout, call.stderr)
            except BaseException:
                # Its exit status would come to the next call: the session ends here.
                self.kill(SessionEnd.DIED)
                raise
            prepared = self._prepared
            exchange = PayloadExchange(payload, limits.max_output_bytes, events)
            result = await drive(
                proc,
                exchange,
                b"",  # the token line is in already
                limits.timeout_ms / 1000,
                lambda: None,  # the call's own end kills nothing: ``proc.kill`` decides
                # The session's limits as a whole: its cgroup, or rootless without one the
                # sums over the sandbox's processes (the agent's reaped calls included).
                prepared._breached_limit(exchange.stderr),
            )
        finally:
            proc.detach()
        exchange.stderr.close()  # a last event line that lacks its newline
        answer = outcome(
            result,
            True,
            call.token,
            (time.monotonic() - started) * 1000,
            False,
            missing=self._prepared._missing,
            cgroup=self._prepared._cgroup,
            limits=limits,
        )
        if result.ending is not Ending.EXITED or answer.reason in _ENDS_SESSION:
            self.kill(SessionEnd.LIMIT)
        elif self._end is None:
            with contextlib.suppress(SandboxUnavailable):  # the next call says so
                self._ahead = self._start_call()
        return answer

    def kill(self, why: SessionEnd) -> None:
        """End the session now: every process of its sandbox is killed (not waited for)."""
        if self._end is None:
            self._end = why
        self._prepared._kill_now()

    async def close(self) -> None:
        if self._end is None:
            self._end = SessionEnd.DIED
        self._control.close()  # the agent reads the end of its socket
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()
        await self._prepared.close()


@dataclasses.dataclass(frozen=True)
class _Started:
    """A call's process started by the agent: its token, and our ends of its pipes."""

    token: str
    stdin: int
    stdout: int
    stderr: int

    def close(self) -> None:
        for fd in (self.stdin, self.stdout, self.stderr):
            os.close(fd)


class _CallProcess:
    """One call in the session, as ``drive`` sees a process: its pipes, and its exit
    status as the agent reports it."""

    def __init__(self, session: SubprocessSession) -> None:
        self._session = session
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self.returncode: int | None = None
        self._transports: list[asyncio.BaseTransport] = []
        self._status: asyncio.Task[int] | None = None

    async def attach(self, stdin: int, stdout: int, stderr: int) -> None:
        loop = asyncio.get_running_loop()
        files = [os.fdopen(stdout, "rb", buffering=0), os.fdopen(stderr, "rb", buffering=0)]
        writer = os.fdopen(stdin, "wb", buffering=0)
        self._status = loop.create_task(self._receive(loop))
        try:
            self.stdout, transport = await _reader(loop, files[0])
            self._transports.append(transport)
            self.stderr, transport = await _reader(loop, files[1])
            self._transports.append(transport)
            transport, protocol = await loop.connect_write_pipe(_WriteProtocol, writer)
            self._transports.append(transport)
            self.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        except BaseException:
            for file in (*files, writer):
                file.close()
            raise

    async def _receive(self, loop: asyncio.AbstractEventLoop) -> int:
        try:
            status = await loop.sock_recv(self._session._control, AGENT_MESSAGE_BYTES)
        except OSError:
            status = b""
        try:
            self.returncode = int(status)
        except ValueError:  # the agent is gone: killed with its session
            self._session.kill(SessionEnd.DIED)
            self.returncode = -9
        return self.returncode

    async def wait(self) -> int:
        assert self._status is not None
        return await asyncio.shield(self._status)

    def kill(self) -> None:
        if self.returncode is None:
            self._session.kill(SessionEnd.LIMIT)

    def detach(self) -> None:
        if self._status is not None and not self._status.done():
            self._status.cancel()
        close_transports(self._transports)
