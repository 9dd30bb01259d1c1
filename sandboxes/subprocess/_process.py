"""Driving one launched process: speak on stdin, read stdout and stderr, enforce the clock.

stdin is written (by the run's ``sandboxes._exchange`` strategy: one payload, or a
dialogue) while stdout and stderr are read, so neither a tool that floods stderr nor one
that never reads its input can block the runner. The call ends when the tool's main
process exits (not when its pipes close: a leftover child may hold them open), when the
exchange says so (a dialogue's end), when stdout passes its cap, when the whole tool used
up its CPU time or had a process OOM-killed, or at the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sandboxes._exchange import Exchange, StdoutSink
from sandboxes._streams import OutputOverflow
from sandboxes.cancellation import finish_shielded
from sandboxes.events import StderrSplitter
from sandboxes.view import READ_CHUNK

if TYPE_CHECKING:
    from sandboxes.subprocess._cgroup import CallCgroup

# How often the limits of the whole tool (CPU time, OOM kills, over all its processes)
# are checked: 50 ms after the start, then twice as long each time up to 0.2 s. Each look
# reads cgroup files: at a steady 50 ms that was ~10 files a call under load, where a
# call lasts ~300 ms. A limit is enforced by the kernel all along; the look only ends the
# call, with its error, when a process other than the main one broke it.
LIMITS_POLL_S = 0.05
LIMITS_POLL_MAX_S = 0.2
# After the main process is gone and the rest killed, pipes reach EOF at once; this only
# bounds the wait should something still hold them.
DRAIN_GRACE_S = 0.5
# A SIGKILLed process is reaped at once; this only bounds the wait for one the kernel is
# slow to take down (uninterruptible sleep). Teardown kills its cgroup in any case.
EXIT_GRACE_S = 2.0


class Ending(enum.Enum):
    EXITED = "exited"
    TIMEOUT = "timeout"
    OUTPUT_LIMIT = "output_limit"
    CPU_BUDGET = "cpu_budget"
    MEMORY_LIMIT = "memory_limit"  # the kernel OOM-killed some process of the tool
    FINISHED = "finished"  # the exchange ended the run: a dialogue's ``talk`` returned


class WholeLimits:
    """A limit of a tool as a whole that is already broken, read from its cgroup (polled
    while it runs): a process of it the kernel OOM-killed, or socket buffers past its
    share, is its memory limit; its CPU time, read again only once it could have run out
    (all its processes together use at most one second per CPU per second), its CPU limit."""

    def __init__(self, group: CallCgroup, cpu_seconds: int) -> None:
        self._group = group
        self._cpu_seconds = cpu_seconds
        self._cpu_look_at = 0.0  # when the CPU time is read next

    def breached(self) -> Ending | None:
        if self._group.oom_kills() > 0 or self._group.sockets_overran():
            return Ending.MEMORY_LIMIT
        now = time.monotonic()
        if now >= self._cpu_look_at:
            left = self._cpu_seconds - self._group.cpu_seconds()
            if left < 0:
                return Ending.CPU_BUDGET
            self._cpu_look_at = now + left / (os.cpu_count() or 1)
        return None


class Driven(Protocol):
    """A started process as ``drive`` uses it: asyncio's own, or one attached later
    (``_attach.AttachedProcess``, a warm sandbox's)."""

    stdin: asyncio.StreamWriter | None
    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class ProcessResult:
    ending: Ending
    returncode: int | None
    stdout: bytes
    stderr_tail: str


class _WriterStdin:
    """The tool's stdin pipe as an exchange writes it."""

    def __init__(self, writer: asyncio.StreamWriter | None) -> None:
        self._writer = writer

    async def write(self, data: bytes) -> None:
        writer = self._writer
        if writer is None or writer.is_closing():
            raise ConnectionResetError("the tool's stdin is closed")
        writer.write(data)
        await writer.drain()  # BrokenPipeError, ConnectionResetError: the tool closed it

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._writer.close()


async def _read_all(stream: asyncio.StreamReader | None, sink: StderrSplitter) -> None:
    if stream is None:
        return
    while chunk := await stream.read(READ_CHUNK):
        sink.feed(chunk)


async def _read_capped(stream: asyncio.StreamReader | None, sink: StdoutSink) -> bool:
    """Read to the end; True when the tool wrote past the cap (reading stops there)."""
    if stream is None:
        return False
    try:
        while chunk := await stream.read(READ_CHUNK):
            sink.feed(chunk)
    except OutputOverflow:
        return True
    sink.close()
    return False


async def drive(
    proc: Driven,
    exchange: Exchange,
    preamble: bytes,
    timeout_s: float,
    kill_all: Callable[[], None],
    breached: Callable[[], Ending | None] | None = None,
) -> ProcessResult:
    """Run ``proc`` to its end under the limits, ``exchange`` speaking with it (after
    ``preamble``); everything it started is dead on return. stderr goes to the
    exchange's ``stderr`` (its events handed on as they come).

    However it ends (cancellation included) the tool is killed and, shielded from
    further cancellation, reaped and its pipes drained before this returns or raises.

    Raises:
        asyncio.CancelledError: the caller was cancelled; the tool is dead by then.
    """
    stderr = exchange.stderr
    try:
        async with asyncio.TaskGroup() as tasks:
            speaker = tasks.create_task(exchange.speak(_WriterStdin(proc.stdin), preamble))
            err_reader = tasks.create_task(_read_all(proc.stderr, stderr))
            out_reader = tasks.create_task(_read_capped(proc.stdout, exchange.stdout))
            waiter = tasks.create_task(proc.wait())
            try:
                ending = await _watch(timeout_s, waiter, out_reader, speaker, breached)
            finally:
                # Main process gone or the call is over: nothing of the tool may outlive it.
                kill_all()
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                # Nothing is to be said to a dead tool (a dialogue's ``talk`` ends here).
                speaker.cancel()
                await finish_shielded(_reap(waiter, (speaker, err_reader, out_reader)))
    finally:
        _close_transport(proc)
    if ending is Ending.EXITED and _overflowed(out_reader):
        ending = Ending.OUTPUT_LIMIT
    return ProcessResult(
        ending=ending,
        returncode=proc.returncode,
        stdout=exchange.output(),
        stderr_tail=stderr.text(),
    )


async def _watch(
    timeout_s: float,
    waiter: asyncio.Task[int],
    out_reader: asyncio.Task[bool],
    speaker: asyncio.Task[bool],
    breached: Callable[[], Ending | None] | None,
) -> Ending:
    """Wait for what ends the run: the exchange says so (a dialogue's end), stdout
    overflows, the main process exits, a limit of the whole tool breaks (polled) or the
    timeout passes."""
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + timeout_s
    watched: set[asyncio.Task[Any]] = {waiter, out_reader, speaker}
    poll_every = LIMITS_POLL_S
    while True:
        left = ends_at - loop.time()
        if left <= 0:
            return Ending.TIMEOUT
        poll = min(left, poll_every) if breached else left
        done, _ = await asyncio.wait(watched, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
        if speaker in done:
            watched.discard(speaker)
            if speaker.result():
                # Before the exit: a tool that ends right after its last answer was heard.
                return Ending.FINISHED
        if out_reader in done:
            watched.discard(out_reader)
            if out_reader.result():
                return Ending.OUTPUT_LIMIT
        if waiter in done:
            return Ending.EXITED
        # Polled when the poll's time is up, not on every wake (the payload written, the
        # end of stdout): each look reads two cgroup files.
        if breached is not None and not done:
            if (ending := breached()) is not None:
                return ending
            poll_every = min(poll_every * 2, LIMITS_POLL_MAX_S)


async def _reap(waiter: asyncio.Task[int], helpers: tuple[asyncio.Task[Any], ...]) -> None:
    """After the kill: wait (bounded) for the main process and for the pipes' end, then
    stop what still waits. Something may hold a pipe only if the kill missed it."""
    await asyncio.wait({waiter}, timeout=EXIT_GRACE_S)
    pending = [task for task in helpers if not task.done()]
    if pending:
        await asyncio.wait(pending, timeout=DRAIN_GRACE_S)
    for task in (waiter, *helpers):
        task.cancel()  # no-op on what has ended; the task group awaits the rest


def _overflowed(task: asyncio.Task[bool]) -> bool:
    return task.done() and not task.cancelled() and task.result()


def _close_transport(proc: Driven) -> None:
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()
