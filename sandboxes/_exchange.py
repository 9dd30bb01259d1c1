"""What passes over a running tool's stdin and stdout, the same way in every backend.

A backend starts the tool, reads its stdout into the exchange's ``stdout`` sink (whose
``feed`` raises ``OutputOverflow`` past the cap: the run then ends as ``output_limit``),
and runs the exchange's ``speak`` with the tool's stdin, while it watches the clock and
the limits. Two exchanges exist:

- ``PayloadExchange`` (``run``): write one payload, close stdin, keep stdout as the
  outcome's; the run ends when the tool exits.
- ``DialogueExchange`` (``converse``): let a ``Dialogue`` talk with the tool through a
  ``Pipe``; the run ends when ``talk`` returns (``speak`` says so by returning True).

``preamble`` is what the backend itself must write before the exchange speaks: the exec
guard's token line, docker's gate release. The exchange writes it first, so that the
tool's own stdin starts right after it.

A dialogue with a primed tool (``sandboxes._priming``) starts where the opening stopped:
its ``receive`` gets the opening's unread bytes first, and the cap is what the opening
left of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from sandboxes._priming import Opened
from sandboxes._streams import OutputOverflow, TailBuffer
from sandboxes.base import Dialogue
from sandboxes.events import EventSink, OutputBudget, StderrSplitter
from sandboxes.view import READ_CHUNK, STDERR_TAIL_BYTES


class Stdin(Protocol):
    """The write end of a running tool's stdin, as a backend gives it."""

    async def write(self, data: bytes) -> None:
        """Write all of ``data`` (waiting while the tool does not read).

        Raises:
            ConnectionError: the tool closed its stdin, or is gone.
        """
        ...

    def close(self) -> None:
        """End of input (the tool reads EOF); never raises."""
        ...


class StdoutSink(Protocol):
    """Where a backend puts what the tool writes on stdout."""

    def feed(self, data: bytes) -> None:
        """Take the next bytes.

        Raises:
            OutputOverflow: the run's ``max_output_bytes`` is passed; feed nothing more.
        """
        ...

    def close(self) -> None:
        """The tool closed its stdout (not called after an overflow)."""
        ...


class Exchange(Protocol):
    """One strategy of speaking with a tool: ``PayloadExchange`` or ``DialogueExchange``."""

    # True: the tool's exit with status 0 is a run's good end (``run``). False: only the
    # exchange's own end is (``converse``); an exit before it, even 0, is ``exit_code``.
    ends_by_exit: bool

    @property
    def stdout(self) -> StdoutSink: ...

    @property
    def stderr(self) -> StderrSplitter:
        """Where the backend puts what the tool writes on stderr (``sandboxes.events``)."""
        ...

    async def speak(self, stdin: Stdin, preamble: bytes) -> bool:
        """Write ``preamble``, then speak with the tool; True when this end of speaking
        ends the run (the tool is then killed), False when the tool's exit does. Never
        raises but for cancellation."""
        ...

    def output(self) -> bytes:
        """The outcome's ``stdout``."""
        ...


class _CappedStdout:
    """stdout kept whole, within the budget it shares with the run's events."""

    def __init__(self, budget: OutputBudget) -> None:
        self._budget = budget
        self._chunks: list[bytes] = []

    def feed(self, data: bytes) -> None:
        if not self._budget.take(len(data)):
            raise OutputOverflow
        self._chunks.append(data)

    def close(self) -> None:
        pass  # all of it is the outcome's, whenever it ends

    def getvalue(self) -> bytes:
        return b"".join(self._chunks)


class PayloadExchange:
    """``run``'s exchange: one payload in, stdout kept up to the cap; the tool's events
    (``sandboxes.events``) to ``events``, drawing on the same cap."""

    ends_by_exit = True

    def __init__(self, payload: bytes, max_output: int, events: EventSink | None = None) -> None:
        self._payload = payload
        budget = OutputBudget(max_output)
        self._stdout = _CappedStdout(budget)
        self._stderr = StderrSplitter(TailBuffer(STDERR_TAIL_BYTES), events, budget)

    @property
    def stdout(self) -> StdoutSink:
        return self._stdout

    @property
    def stderr(self) -> StderrSplitter:
        return self._stderr

    async def speak(self, stdin: Stdin, preamble: bytes) -> bool:
        try:
            with contextlib.suppress(ConnectionError):  # the tool closed its stdin: its business
                await stdin.write(preamble + self._payload)
        finally:
            stdin.close()
        return False

    def output(self) -> bytes:
        return self._stdout.getvalue()


class _PipeStdout:
    """stdout as the dialogue reads it: counted against the cap, then queued for ``receive``.

    The queue never holds more than the cap (the backend reads on, whether the dialogue
    receives or not: stderr and the tool's exit must still be seen)."""

    def __init__(self, max_output: int) -> None:
        self.reader = asyncio.StreamReader()
        self._left = max_output

    def feed(self, data: bytes) -> None:
        self._left -= len(data)
        if self._left < 0:
            raise OutputOverflow  # never queued: ``receive`` waits until the run's end cancels it
        self.reader.feed_data(data)

    def close(self) -> None:
        self.reader.feed_eof()


class _DialoguePipe:
    """The ``Pipe`` a dialogue's ``talk`` gets."""

    def __init__(self, stdin: Stdin, stdout: asyncio.StreamReader) -> None:
        self._stdin = stdin
        self._stdout = stdout

    async def send(self, data: bytes) -> None:
        await self._stdin.write(data)

    async def receive(self) -> bytes:
        return await self._stdout.read(READ_CHUNK)


class DialogueExchange:
    """``converse``'s exchange: the dialogue speaks until its ``talk`` returns.

    ``talk`` must not raise; should it, the error is kept in ``failure`` (the run ends as
    if ``talk`` had returned) for the backend to raise once the tool is dead.
    """

    ends_by_exit = False

    def __init__(self, dialogue: Dialogue, max_output: int, opened: Opened | None = None) -> None:
        self._dialogue = dialogue
        self._stdout = _PipeStdout(max_output - (opened.spent if opened is not None else 0))
        if opened is not None and opened.unread:
            self._stdout.feed(opened.unread)  # within the cap: the opening counted it
        # A server speaks on stdout: event lines on its stderr are dropped.
        tail = opened.stderr if opened is not None else TailBuffer(STDERR_TAIL_BYTES)
        self._stderr = StderrSplitter(tail, None, None)
        self.failure: Exception | None = None

    @property
    def stdout(self) -> StdoutSink:
        return self._stdout

    @property
    def stderr(self) -> StderrSplitter:
        return self._stderr

    async def speak(self, stdin: Stdin, preamble: bytes) -> bool:
        if preamble:
            with contextlib.suppress(ConnectionError):  # gone already: its exit says how
                await stdin.write(preamble)
        try:
            await self._dialogue.talk(_DialoguePipe(stdin, self._stdout.reader))
        except Exception as exc:  # the backend raises it once the tool is dead
            self.failure = exc
        return True

    def output(self) -> bytes:
        return b""  # what was said is the dialogue's to keep

    def raise_failure(self) -> None:
        """Raise what ``talk`` raised, if it did.

        Raises:
            Exception: ``talk``'s own error (a bug of the dialogue).
        """
        if self.failure is not None:
            raise self.failure
