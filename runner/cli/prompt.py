"""``runner exec`` asks for approval on its terminal: ``/dev/tty``, the terminal the
command runs in, whatever its standard streams are (params piped in with ``@-``, the
answer piped on to ``jq``). A process without one (a service, ``setsid``, CI) cannot ask:
its calls that need approval are refused as ``approval_unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import termios

from runner.call.approval import ApprovalRequest, ApprovalUnavailable, Approver

TTY = "/dev/tty"
YES = ("y", "yes")
MAX_ANSWER_BYTES = 4096


def terminal_approver() -> Approver:
    return Approver("terminal", _ask)


async def _ask(request: ApprovalRequest) -> bool:
    try:
        fd = os.open(TTY, os.O_RDWR | os.O_NOCTTY)
    except OSError as exc:
        raise ApprovalUnavailable(f"runner exec has no terminal to ask on ({TTY}: {exc.strerror})") from exc
    try:
        # What was typed before the question was shown (a "y" for another prompt) is not its answer.
        with contextlib.suppress(termios.error):
            termios.tcflush(fd, termios.TCIFLUSH)
        os.write(fd, f"runner: {request.message()} [y/N] ".encode())
        try:
            answer = await _read_line(fd)
        except asyncio.CancelledError:  # timed out or interrupted: end the prompt's line
            os.write(fd, b"\n")
            raise
    finally:
        os.close(fd)
    return answer.strip().lower() in YES


async def _read_line(fd: int) -> str:
    """One line typed on the terminal (its canonical mode hands over whole lines), read on
    the event loop so that the approval's timeout or a Ctrl-C ends the wait at once."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future[bytes] = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(fd, MAX_ANSWER_BYTES)
        except OSError:
            data = b""  # the terminal went away: no answer is a no
        if not line.done():
            line.set_result(data)

    loop.add_reader(fd, readable)
    try:
        return (await line).decode("utf-8", errors="replace")
    finally:
        loop.remove_reader(fd)
