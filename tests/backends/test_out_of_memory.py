"""Without a cgroup (rootless), a refused allocation is read from the tool's stderr: the
lines the runtimes write are recognised, and words that merely appear in a line are not
(an honest tool echoing its input must not be stopped as out of memory)."""

from __future__ import annotations

import pytest

from sandboxes.subprocess._outcome import out_of_memory


@pytest.mark.parametrize(
    "said",
    [
        "Traceback (most recent call last):\n  ...\nMemoryError",
        "MemoryError: cannot grow the buffer",
        "bash: fork: Cannot allocate memory",
        "terminate called after throwing an instance of 'std::bad_alloc'",
        "FATAL ERROR: Reached heap limit Allocation failed - JavaScript heap out of memory",
        "fatal error: runtime: out of memory",
    ],
)
def test_the_runtimes_own_lines_are_read_as_out_of_memory(said: str) -> None:
    assert out_of_memory(f"earlier output\n{said}\n")


@pytest.mark.parametrize(
    "said",
    [
        "the user asked about MemoryError",
        "input: Cannot allocate memory (quoted) in the ticket",
        "std::bad_alloc is a C++ exception",
        "note: JavaScript heap out of memory happens to others",
    ],
)
def test_the_words_inside_another_line_are_not(said: str) -> None:
    assert not out_of_memory(f"{said}\n")
