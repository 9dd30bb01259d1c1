"""Driving one launched process: feed stdin, read stdout and stderr, enforce the clock.

stdin is written while stdout and stderr are read, so neither a tool that floods stderr
nor one that never reads its input can block the runner. The call ends when the tool's
main process exits (not when its pipes close: a leftover child may hold them open), when
stdout passes its cap, when the whole tool used up its CPU time or had a process
OOM-killed, or at the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass

from sandboxes._streams import CappedBuffer, OutputOverflow, TailBuffer
from sandboxes.view import READ_CHUNK, STDERR_TAIL_BYTES

# How often the limits of the whole tool (CPU time, OOM kills, over all its processes)
# are checked.
LIMITS_POLL_S = 0.05
# After the main process is gone and the rest killed, pipes reach EOF at once; this only
# bounds the wait should something still hold them.
DRAIN_GRACE_S = 0.5


class Ending(enum.Enum):
    EXITED = "exited"
    TIMEOUT = "timeout"
    OUTPUT_LIMIT = "output_limit"
    CPU_BUDGET = "cpu_budget"
    MEMORY_LIMIT = "memory_limit"  # the kernel OOM-killed some process of the tool


@dataclass(frozen=True)
class ProcessResult:
    ending: Ending
    returncode: int | None
    stdout: bytes
    stderr_tail: str


async def _feed(stream: asyncio.StreamWriter | None, payload: bytes) -> None:
    if stream is None:
        return
    try:
        stream.write(payload)
        await stream.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the tool closed its stdin: its business, not a runner failure
    finally:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stream.close()


async def _read_all(stream: asyncio.StreamReader | None, sink: CappedBuffer | TailBuffer) -> None:
    if stream is None:
        return
    while chunk := await stream.read(READ_CHUNK):
        sink.feed(chunk)


async def drive(
    proc: asyncio.subprocess.Process,
    payload: bytes,
    timeout_s: float,
    max_output: int,
    kill_all: Callable[[], None],
    breached: Callable[[], Ending | None] | None = None,
) -> ProcessResult:
    """Run ``proc`` to its end under the limits; everything it started is dead on return."""
    loop = asyncio.get_running_loop()
    stdout, stderr = CappedBuffer(max_output), TailBuffer(STDERR_TAIL_BYTES)
    feeder = asyncio.ensure_future(_feed(proc.stdin, payload))
    out_reader = asyncio.ensure_future(_read_all(proc.stdout, stdout))
    err_reader = asyncio.ensure_future(_read_all(proc.stderr, stderr))
    waiter = asyncio.ensure_future(proc.wait())
    ends_at = loop.time() + timeout_s
    ending: Ending | None = None
    try:
        watched: set[asyncio.Future[object]] = {waiter, out_reader}  # type: ignore[arg-type]
        while ending is None:
            left = ends_at - loop.time()
            if left <= 0:
                ending = Ending.TIMEOUT
                break
            poll = min(left, LIMITS_POLL_S) if breached else left
            done, _ = await asyncio.wait(watched, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
            if out_reader in done:
                watched.discard(out_reader)
                if isinstance(out_reader.exception(), OutputOverflow):
                    ending = Ending.OUTPUT_LIMIT
            if waiter in done and ending is None:
                ending = Ending.EXITED
            if ending is None and breached is not None:
                ending = breached()
    finally:
        # Main process gone or the call is over: nothing of the tool may outlive it.
        kill_all()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.wait({waiter}, timeout=DRAIN_GRACE_S * 4)
        pending = [t for t in (feeder, out_reader, err_reader) if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=DRAIN_GRACE_S)
        for task in (feeder, out_reader, err_reader, waiter):
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        _close_transport(proc)
    if ending is Ending.EXITED and _overflowed(out_reader):
        ending = Ending.OUTPUT_LIMIT
    return ProcessResult(
        ending=ending,
        returncode=proc.returncode,
        stdout=stdout.getvalue(),
        stderr_tail=stderr.text(),
    )


def _overflowed(task: asyncio.Future[None]) -> bool:
    return task.done() and not task.cancelled() and isinstance(task.exception(), OutputOverflow)


def _close_transport(proc: asyncio.subprocess.Process) -> None:
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()
