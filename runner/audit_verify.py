"""``runner audit verify``: walk a hash-chained audit log and name what was tampered with.

The file is streamed, one bounded line at a time, and checked byte for byte: a line's hash
is recomputed from its own text (``audit_chain.split_line``), so any changed byte shows,
even one a JSON parser would not see. Each line's ``prevHash`` must be the ``hash`` of the
line before it (``GENESIS`` for the first chained line, and after a line that carries no
hash: that is how the writers link, ``audit_chain._last_hash``).

What each problem means (``kind``):

- ``changed``: the line's hash does not match its text (an edit that did not recompute it).
- ``removed``: its ``prevHash`` is not the previous line's hash: lines were removed before
  it, or the previous line was rewritten with a recomputed hash.
- ``inserted``: the next line links past it to the line before it.
- ``unchained``: no chain fields, after chained lines.
- ``broken``: not a JSON object (or longer than ``MAX_LINE_BYTES``), in the middle of the file.
- ``truncated``: the last line has no newline or is not JSON (the file was cut).

What no chain can show is the removal of the last lines: compare ``head`` (the last hash)
with one recorded elsewhere for that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from runner import audit_chain
from runner.audit_chain import GENESIS, HASH_FIELD, PREV_FIELD
from runner.audit_query import bounded_lines

MAX_LINE_BYTES = 1 << 20  # far above any line the runner writes (16 KiB and the chain fields)
MAX_PROBLEMS = 100  # kept to show; all are counted
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ChainProblem:
    line: int  # 1-based
    kind: str
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {"line": self.line, "kind": self.kind, "detail": self.detail}


@dataclass
class ChainVerdict:
    """What ``verify`` found: ``intact`` when no problem was."""

    lines: int = 0
    chained: int = 0
    head: str | None = None  # the last line's hash: record it elsewhere to detect a cut tail
    problems: list[ChainProblem] = field(default_factory=list)  # the first MAX_PROBLEMS
    problem_count: int = 0

    @property
    def intact(self) -> bool:
        return self.problem_count == 0

    def as_json(self) -> dict[str, Any]:
        return {
            "intact": self.intact,
            "lines": self.lines,
            "chained": self.chained,
            "head": self.head,
            "problemCount": self.problem_count,
            "problems": [problem.as_json() for problem in self.problems],
        }


class _Walk:
    """The state of one pass: what the next line's ``prevHash`` may be."""

    def __init__(self) -> None:
        self.verdict = ChainVerdict()
        self.expected: str | None = GENESIS  # None: unknown (after a damaged line), anything goes
        self.before_previous: str | None = None  # the hash two lines back, to tell an insertion
        self.seen_chain = False

    def problem(self, line: int, kind: str, detail: str) -> None:
        self.verdict.problem_count += 1
        if len(self.verdict.problems) < MAX_PROBLEMS:
            self.verdict.problems.append(ChainProblem(line, kind, detail))

    def lost_track(self, reset_to: str | None = None) -> None:
        self.expected, self.before_previous = reset_to, None

    def take(self, number: int, raw: bytes | None) -> None:
        self.verdict.lines = number
        if raw is None:
            self.problem(number, "broken", f"longer than {MAX_LINE_BYTES} bytes")
            return self.lost_track()
        if not raw.endswith(b"\n"):
            self.problem(number, "truncated", "the last line has no newline: the file was cut")
            return self.lost_track()
        line = raw[:-1]
        parts = audit_chain.split_line(line)
        if parts is None:
            return self._unchained(number, line)
        body, claimed = parts
        if audit_chain.digest(body) != claimed:
            self.problem(number, "changed", "its hash does not match its text: the line was edited")
            return self.lost_track()
        prev_hash = _prev_hash(body)
        if prev_hash is None:
            self.problem(number, "broken", "it ends with a hash but is not a chained event")
            return self.lost_track()
        self.verdict.chained += 1
        self.seen_chain = True
        self._link(number, prev_hash)
        self.before_previous, self.expected = self.expected, claimed
        self.verdict.head = claimed
        return None

    def _unchained(self, number: int, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            self.problem(number, "broken", "not a JSON object")
        elif self.seen_chain:
            self.problem(number, "unchained", "no hash and prevHash after chained lines")
        # Writers link the line after one without a hash to GENESIS.
        self.lost_track(GENESIS if isinstance(event, dict) and not self.seen_chain else None)

    def _link(self, number: int, prev_hash: str) -> None:
        if self.expected is None or prev_hash == self.expected:
            return
        if self.before_previous is not None and prev_hash == self.before_previous:
            # This line links past the previous one: that one was inserted (its own link may
            # already have been reported as a removal: it is the same problem).
            last = self.verdict.problems[-1] if self.verdict.problems else None
            if last is not None and last.line == number - 1 and last.kind == "removed":
                self.verdict.problems.pop()
                self.verdict.problem_count -= 1
            self.problem(number - 1, "inserted", f"line {number} links past it to line {number - 2}")
            return
        where = (
            "the genesis value a first chained line carries"
            if self.expected == GENESIS
            else (f"line {number - 1}'s hash")
        )
        self.problem(
            number,
            "removed",
            f"its prevHash is not {where}: lines were removed before it, "
            "or the line before it was rewritten with a new hash",
        )


def _prev_hash(body: bytes) -> str | None:
    try:
        event = json.loads(body)
    except ValueError:
        return None
    if not isinstance(event, dict) or HASH_FIELD in event or "event" not in event:
        return None
    value = event.get(PREV_FIELD)
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        return None
    return value


def verify_stream(stream: BinaryIO) -> ChainVerdict:
    """Check every line of ``stream``; memory stays bounded by ``MAX_LINE_BYTES``.

    Raises:
        OSError: the stream cannot be read.
    """
    walk = _Walk()
    for number, raw in enumerate(bounded_lines(stream, MAX_LINE_BYTES), start=1):
        walk.take(number, raw)
    verdict = walk.verdict
    if verdict.problems and verdict.problems[-1].line == verdict.lines:
        last = verdict.problems[-1]
        if last.kind == "broken":  # a last line that is not JSON: the tail was cut mid-line
            verdict.problems[-1] = ChainProblem(last.line, "truncated", f"the last line is {last.detail}")
    if verdict.lines and not verdict.chained:
        walk.problem(1, "unchained", "no line of the file is chained (is audit.chain on?)")
    return verdict


def verify(path: Path) -> ChainVerdict:
    """Check the chain of the log at ``path``.

    Raises:
        OSError: it cannot be opened or read.
    """
    with path.open("rb") as stream:
        return verify_stream(stream)
