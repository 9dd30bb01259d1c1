"""``sandboxes.events.StderrSplitter``: event lines out of a tool's stderr as it streams,
however the stream is cut into reads, within the output budget, never held past it."""

from __future__ import annotations

import pytest

from sandboxes._streams import TailBuffer
from sandboxes.events import OutputBudget, StderrSplitter

STREAM = b'plain one\n\x1e{"progress": 1}\nmid\x1e not an event\n\x1e{"log": "info"}\nlast'


class Heard:
    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.dropped = 0

    def event(self, record: bytes) -> None:
        self.records.append(record)

    def ignored(self) -> None:
        self.dropped += 1


def split(chunks: list[bytes], cap: int = 1 << 20) -> tuple[Heard, StderrSplitter, OutputBudget]:
    heard, budget = Heard(), OutputBudget(cap)
    splitter = StderrSplitter(TailBuffer(4096), heard, budget)
    for chunk in chunks:
        splitter.feed(chunk)
    splitter.close()
    return heard, splitter, budget


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
def test_event_lines_are_split_out_whatever_the_reads_and_the_rest_is_the_tail(size: int) -> None:
    heard, splitter, _ = split([STREAM[i : i + size] for i in range(0, len(STREAM), size)])
    assert heard.records == [b'{"progress": 1}', b'{"log": "info"}']
    # A mark inside a line is the tool's text: only a line's first byte makes an event.
    assert splitter.text() == "plain one\nmid\x1e not an event\nlast"


def test_events_draw_on_the_output_budget_and_what_does_not_fit_is_dropped_and_counted() -> None:
    heard, _, budget = split([b"\x1e" + b"a" * 60 + b"\n", b"\x1e" + b"b" * 60 + b"\n"], cap=100)
    assert heard.records == [b"a" * 60]
    assert heard.dropped == 1
    assert budget.left == 40


def test_a_huge_event_line_is_dropped_as_it_streams_never_held() -> None:
    heard, budget = Heard(), OutputBudget(1000)
    splitter = StderrSplitter(TailBuffer(4096), heard, budget)
    splitter.feed(b"\x1e")
    for _ in range(100):
        splitter.feed(b"x" * 65536)
        assert splitter._record is None  # what it holds is the point
    splitter.feed(b"\nafter\n")
    assert heard.records == []
    assert heard.dropped == 1
    assert splitter.text() == "after\n"


def test_without_a_sink_event_lines_are_dropped_from_the_tail() -> None:
    splitter = StderrSplitter(TailBuffer(4096), None, None)
    splitter.feed(b'\x1e{"progress": 1}\nwords\n')
    assert splitter.text() == "words\n"


def test_an_event_line_cut_by_the_end_of_the_stream_is_handed_on_at_close() -> None:
    heard, _, _ = split([b'\x1e{"progress": 1}'])
    assert heard.records == [b'{"progress": 1}']


def test_a_tail_cut_inside_a_character_begins_at_the_next_one() -> None:
    # Decoded with its stray last bytes, the tail began with U+FFFD, and a secret cut
    # there kept its end out of the reach of the scrub of a cut tail.
    tail = TailBuffer(8)
    tail.feed("xü".encode() + b"abcdefg")
    assert tail.text() == "abcdefg"
    whole = TailBuffer(8)
    whole.feed(b"\x80abc")  # not cut: what the tool wrote, as it wrote it
    assert whole.text() == "\ufffdabc"
