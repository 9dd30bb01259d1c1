"""Events from a running tool: lines of its stderr that begin with U+001E (record
separator), each followed by one JSON text, in the manner of RFC 7464.

A backend reads the tool's stderr through a ``StderrSplitter``: event lines go to the
run's ``EventSink`` as they complete (never part of the stderr tail), the rest to the
tail. What the events mean is not the backend's business: it hands on each line's bytes,
within the run's output budget (``max_output_bytes``, shared with stdout), and says how
many it dropped. A line longer than what is left of the budget is dropped as it streams
in, never held whole.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sandboxes._streams import TailBuffer

EVENT_MARK = b"\x1e"  # U+001E in UTF-8: one byte


class EventSink(Protocol):
    """Where a run's events go, on the run's event loop, as they arrive."""

    def event(self, record: bytes) -> None:
        """One event line's text, without its mark and newline (not parsed: it may be any
        bytes). Must not block; never raises."""
        ...

    def ignored(self) -> None:
        """An event line was dropped unread: it did not fit in the output budget."""
        ...


@runtime_checkable
class StreamsEvents(Protocol):
    """A prepared sandbox that can hand its run's events on while the tool runs."""

    def stream_events(self, sink: EventSink) -> None:
        """Send the events of the coming ``run`` to ``sink`` (before ``run``; without
        this call they are dropped). Never raises."""
        ...


class OutputBudget:
    """What is left of a run's ``max_output_bytes``, drawn by stdout and events alike."""

    def __init__(self, cap: int) -> None:
        self.left = cap

    def take(self, size: int) -> bool:
        """Draw ``size`` bytes; False (and nothing drawn) when fewer are left."""
        if size > self.left:
            return False
        self.left -= size
        return True


class StderrSplitter:
    """A tool's stderr on its way to the run's tail, less its event lines.

    ``sink`` None: event lines are dropped (a run nobody listens to, a dialogue)."""

    def __init__(self, tail: TailBuffer, sink: EventSink | None, budget: OutputBudget | None) -> None:
        self._tail = tail
        self._sink = sink
        self._budget = budget
        self._line_start = True
        self._record: bytearray | None = None  # the event line coming in
        self._dropping = False  # an event line dropped as it streams in

    def feed(self, data: bytes) -> None:
        pos, size = 0, len(data)
        while pos < size:
            if self._record is not None or self._dropping:
                end = data.find(b"\n", pos)
                stop = end if end >= 0 else size
                self._grow(data, pos, stop)
                if end < 0:
                    return
                self._finish()
                pos = end + 1
            elif self._line_start and data[pos] == EVENT_MARK[0]:
                self._record = bytearray() if self._sink is not None else None
                self._dropping = self._sink is None
                pos += 1
            else:
                end = data.find(b"\n", pos)
                if end < 0:
                    self._tail.feed(data[pos:])
                    self._line_start = False
                    return
                self._tail.feed(data[pos : end + 1])
                self._line_start = True
                pos = end + 1

    def _grow(self, data: bytes, start: int, stop: int) -> None:
        record = self._record
        if record is None:
            return
        room = self._budget.left if self._budget is not None else 0
        if len(record) + stop - start > room:
            self._record, self._dropping = None, True
            return
        record += data[start:stop]

    def _finish(self) -> None:
        record, dropped = self._record, self._dropping
        self._record, self._dropping, self._line_start = None, False, True
        sink = self._sink
        if sink is None:
            return
        if record is not None and (self._budget is None or self._budget.take(len(record))):
            sink.event(bytes(record))
        elif record is not None or dropped:
            sink.ignored()

    def close(self) -> None:
        """The stream ended: an event line without its newline is handed on as well."""
        if self._record is not None or self._dropping:
            self._finish()

    def text(self) -> str:
        """The stderr tail, without event lines."""
        return self._tail.text()
