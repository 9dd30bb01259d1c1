"""``runner audit verify``: walk a hash-chained audit log and name what was tampered with.

The file is streamed, one bounded line at a time, and checked byte for byte: a line's hash
is recomputed from its own text (``audit_chain.split_line``), so any changed byte shows,
even one a JSON parser would not see. Each line's ``prevHash`` must be the ``hash`` of the
line before it (``GENESIS`` for the first chained line, and after a line that carries no
hash: that is how the writers link, ``audit_chain._last_hash``). That holds after a damaged
line too: after a ``changed`` line the next must link to the hash it claims, after a torn or
foreign one to ``GENESIS``, so that one damaged line cannot hide lines removed after it.

What each problem means (``kind``):

- ``changed``: the line's hash does not match its text (an edit that did not recompute it).
- ``removed``: its ``prevHash`` is not the previous line's hash: lines were removed before
  it, or the previous line was rewritten with a recomputed hash.
- ``inserted``: the next line links past it to the line before it.
- ``unchained``: no chain fields, in a file with chained lines (before the first one too:
  a forged prefix; lines from before ``chain`` was turned on pass only with
  ``allow_unchained_prefix``, and are counted).
- ``broken``: not a JSON object (or longer than ``MAX_LINE_BYTES``), in the middle of the file.
- ``truncated``: the last line has no newline or is not JSON (the file was cut).
- ``cut``: no intact line has the anchored hash (``--head``): the line recorded by
  ``runner audit head`` was removed, or it or a line before it rewritten.

What no chain can show by itself is the removal of the last lines, and (without a key) a
rewrite of the whole chain from a line on: an anchor, a ``head`` recorded elsewhere, shows
both up to that line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from runner.audit import chain as audit_chain
from runner.audit.chain import GENESIS, HASH_FIELD, PREV_FIELD

MAX_LINE_BYTES = 1 << 20  # far above any line the runner writes (16 KiB and the chain fields)
_TAIL_BYTES = audit_chain.SUFFIX_LENGTH + 1  # what is kept of a longer line: its hash and newline
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
    keyed: bool = False  # checked as HMAC-SHA256 under a key
    hashed: int = 0  # lines that end with a hash, whether it matched or not
    head: str | None = None  # the last line's hash: record it elsewhere to detect a cut tail
    anchor: str | None = None  # the recorded head that must be found (``--head``)
    anchor_line: int | None = None  # where it was found
    unchained_prefix: int = 0  # unchained lines before the first chained one, allowed and skipped
    problems: list[ChainProblem] = field(default_factory=list)  # the first MAX_PROBLEMS
    problem_count: int = 0

    @property
    def intact(self) -> bool:
        return self.problem_count == 0

    @property
    def none_matched(self) -> bool:
        """Lines end with hashes, and not one matches its text: more likely the wrong key (or a
        key for a log written without one, or the reverse) than every line edited."""
        return self.hashed > 0 and self.chained == 0

    def as_json(self) -> dict[str, Any]:
        anchor = None if self.anchor is None else {"hash": self.anchor, "line": self.anchor_line}
        return {
            "intact": self.intact,
            "keyed": self.keyed,
            "lines": self.lines,
            "chained": self.chained,
            "head": self.head,
            "anchor": anchor,
            "unchainedPrefix": self.unchained_prefix,
            "problemCount": self.problem_count,
            "problems": [problem.as_json() for problem in self.problems],
        }


class _Walk:
    """The state of one pass: what the next line's ``prevHash`` must be."""

    def __init__(self, allow_unchained_prefix: bool, key: bytes | None, anchor: str | None) -> None:
        self.verdict = ChainVerdict(keyed=key is not None, anchor=anchor)
        self.key = key
        self.allow_unchained_prefix = allow_unchained_prefix
        # What a writer would link the next line to (``audit_chain._last_hash``): the hash the
        # line before ends with, else GENESIS. Kept after a damaged line too, so that a damaged
        # line cannot hide lines removed after it.
        self.expected = GENESIS
        self.before_previous: str | None = None  # the hash two lines back, to tell an insertion
        self.seen_chain = False
        # Unchained JSON lines before the first chained one: problems once a chained line shows
        # the file is chained (unless allowed); the first MAX_PROBLEMS kept, all counted.
        self.prefix: list[ChainProblem] = []
        self.prefix_count = 0

    def problem(self, line: int, kind: str, detail: str) -> None:
        self.verdict.problem_count += 1
        if len(self.verdict.problems) < MAX_PROBLEMS:
            self.verdict.problems.append(ChainProblem(line, kind, detail))

    def next_links_to(self, value: str) -> None:
        self.before_previous, self.expected = self.expected, value

    def take(self, number: int, raw: bytes | None, tail: bytes = b"") -> None:
        """One line (with its newline); ``raw`` None for one longer than ``MAX_LINE_BYTES``,
        of which ``tail`` holds the last bytes."""
        self.verdict.lines = number
        if raw is None:
            self.problem(number, "broken", f"longer than {MAX_LINE_BYTES} bytes")
            return self.next_links_to(_ending_hash(tail))
        if not raw.endswith(b"\n"):
            self.problem(number, "truncated", "the last line has no newline: the file was cut")
            return self.next_links_to(GENESIS)
        line = raw[:-1]
        parts = audit_chain.split_line(line)
        if parts is None:
            return self._unchained(number, line)
        body, claimed = parts
        self.verdict.hashed += 1
        prev_hash = _prev_hash(body)
        if audit_chain.digest(body, self.key) != claimed:
            self.problem(number, "changed", "its hash does not match its text: the line was edited")
            if prev_hash is not None:  # an edit does not hide lines removed before the line
                self._link(number, prev_hash)
            # The next line must still link to the hash this one claims (its original one).
            return self.next_links_to(claimed)
        if prev_hash is None:
            self.problem(number, "broken", "it ends with a hash but is not a chained event")
            return self.next_links_to(claimed)
        self.verdict.chained += 1
        if not self.seen_chain:
            self._first_chained()
        self._link(number, prev_hash)
        self.next_links_to(claimed)
        self.verdict.head = claimed
        if claimed == self.verdict.anchor and self.verdict.anchor_line is None:
            self.verdict.anchor_line = number
        return None

    def _unchained(self, number: int, line: bytes) -> None:
        event = _json_object(line)
        if event is None:
            self.problem(number, "broken", "not a JSON object")
        elif self.seen_chain:
            self.problem(number, "unchained", "no hash and prevHash after chained lines")
        else:
            self.prefix_count += 1
            if len(self.prefix) < MAX_PROBLEMS:
                self.prefix.append(ChainProblem(number, "unchained", _PREFIX_DETAIL))
        self.next_links_to(GENESIS)  # writers link the line after one without a hash to GENESIS

    def _first_chained(self) -> None:
        """The file is chained: the unchained lines before are problems, unless allowed."""
        self.seen_chain = True
        if self.allow_unchained_prefix:
            self.verdict.unchained_prefix = self.prefix_count
        else:
            # Only the prefix's broken lines are reported so far: merge in line order.
            merged = sorted([*self.verdict.problems, *self.prefix], key=lambda problem: problem.line)
            self.verdict.problems = merged[:MAX_PROBLEMS]
            self.verdict.problem_count += self.prefix_count
        self.prefix = []

    def _link(self, number: int, prev_hash: str) -> None:
        if prev_hash == self.expected:
            return
        if self.before_previous is not None and prev_hash == self.before_previous:
            # This line links past the previous one: that one was inserted. Its own link may
            # already have been reported as a removal: it is the same problem. When it was
            # already named as damaged, that says it: no second problem for it.
            last = self.verdict.problems[-1] if self.verdict.problems else None
            if last is not None and last.line == number - 1:
                if last.kind != "removed":
                    return
                self.verdict.problems.pop()
                self.verdict.problem_count -= 1
            self.problem(number - 1, "inserted", f"line {number} links past it to line {number - 2}")
            return
        where = (
            "the genesis value a first chained line (or one after a line without a hash) carries"
            if self.expected == GENESIS
            else (f"the hash line {number - 1} ends with")
        )
        self.problem(
            number,
            "removed",
            f"its prevHash is not {where}: lines were removed before it, "
            "or the line before it was rewritten with a new hash",
        )


_PREFIX_DETAIL = (
    "no hash and prevHash, before the first chained line: forged, or written before audit.chain "
    "was turned on (then pass --allow-unchained-prefix)"
)


def _ending_hash(line: bytes) -> str:
    """What a writer links the line after ``line`` to: the hash it ends with, else GENESIS."""
    parts = audit_chain.split_line(line.removesuffix(b"\n"))
    return parts[1] if parts is not None else GENESIS


def _json_object(text: bytes) -> dict[str, Any] | None:
    """``text`` parsed, when it is a JSON object; None for anything else, a line nested too
    deep for the parser included."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _prev_hash(body: bytes) -> str | None:
    event = _json_object(body)
    if event is None or HASH_FIELD in event or "event" not in event:
        return None
    value = event.get(PREV_FIELD)
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        return None
    return value


def _lines(stream: BinaryIO) -> Iterator[tuple[bytes | None, bytes]]:
    """Each line (its newline kept; the last may lack one) with b"", or, for a line longer
    than ``MAX_LINE_BYTES``, None with the line's last bytes (enough for its hash)."""
    while True:
        line = stream.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_LINE_BYTES:
            yield line, b""
            continue
        tail = line[-_TAIL_BYTES:]
        while not line.endswith(b"\n"):  # the rest of the long line, never held whole
            line = stream.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            tail = (tail + line)[-_TAIL_BYTES:]
        yield None, tail


def verify_stream(
    stream: BinaryIO,
    allow_unchained_prefix: bool = False,
    key: bytes | None = None,
    anchor: str | None = None,
) -> ChainVerdict:
    """Check every line of ``stream``; memory stays bounded by ``MAX_LINE_BYTES``. With
    ``allow_unchained_prefix``, unchained lines before the first chained one are counted
    (``unchained_prefix``), not problems. With ``key`` the hashes are HMAC-SHA256 under it.
    With ``anchor`` (a head recorded earlier) a line with that hash must be found intact.

    Raises:
        OSError: the stream cannot be read.
    """
    walk = _Walk(allow_unchained_prefix, key, anchor)
    for number, (raw, tail) in enumerate(_lines(stream), start=1):
        walk.take(number, raw, tail)
    verdict = walk.verdict
    if verdict.problems and verdict.problems[-1].line == verdict.lines:
        last = verdict.problems[-1]
        if last.kind == "broken":  # a last line that is not JSON: the tail was cut mid-line
            verdict.problems[-1] = ChainProblem(last.line, "truncated", f"the last line is {last.detail}")
    if verdict.lines and not verdict.chained and not verdict.hashed:
        walk.problem(1, "unchained", "no line of the file is chained (is audit.chain on?)")
    if anchor is not None and verdict.anchor_line is None:
        walk.problem(
            verdict.lines + 1,
            "cut",
            f"no intact line has the anchored hash {anchor}: the line recorded by runner audit head "
            "was removed (the tail was cut), or it or a line before it was rewritten",
        )
    return verdict


def verify(
    path: Path, allow_unchained_prefix: bool = False, key: bytes | None = None, anchor: str | None = None
) -> ChainVerdict:
    """Check the chain of the log at ``path`` (``verify_stream``).

    Raises:
        OSError: it cannot be opened or read.
    """
    with path.open("rb") as stream:
        return verify_stream(stream, allow_unchained_prefix, key, anchor)


@dataclass(frozen=True)
class ChainHead:
    """What ``runner audit head`` prints: the last line's hash (None when the last line has
    none: torn, or unchained) and how many lines the file has."""

    hash: str | None
    lines: int

    def as_json(self) -> dict[str, Any]:
        return {"head": self.hash, "lines": self.lines}


_COUNT_CHUNK = 1 << 20


def read_head(path: Path) -> ChainHead:
    """The last line's hash and the line count, without checking any hash (``verify`` does).

    Raises:
        OSError: the log cannot be opened or read.
    """
    with path.open("rb") as stream:
        lines, last = 0, b""
        while chunk := stream.read(_COUNT_CHUNK):
            lines += chunk.count(b"\n")
            last = (last + chunk)[-(_TAIL_BYTES + 1) :]  # a byte more than split_line needs
    if last and not last.endswith(b"\n"):
        return ChainHead(None, lines + 1)  # a torn last line: the file was cut, or is being written
    parts = audit_chain.split_line(last.removesuffix(b"\n")) if last else None
    return ChainHead(parts[1] if parts is not None else None, lines)
