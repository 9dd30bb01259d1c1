"""Output for a person at a terminal: tables, indented JSON, colour.

The CLI asks ``Output.detect()`` once per command: on a terminal it prints these formats,
piped it prints the machine formats (JSON, JSON lines, plain lines) exactly as before, so
scripts never see a table or a colour code. Colour follows https://no-color.org and
``TERM=dumb``.

Everything shown comes from manifests, tools or the audit log, i.e. from untrusted hands:
every cell and every JSON string goes through ``escape_cell``/``_inert`` so that no escape
sequence or bidi override reaches the terminal.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from runner.audit.query import TABLE_COLUMNS, escape_cell, outcome

if TYPE_CHECKING:
    from runner.cli.doctor import Layer

# SGR codes, by what they mean here rather than by colour name.
_STYLES = {"head": "1", "ok": "32", "bad": "31", "warn": "33", "key": "34", "dim": "2", "value": "36"}
_RESET = "\x1b[0m"
# One JSON token of json.dumps' own output: a string (a key when a colon follows), a number
# or a literal. Strings are consumed whole, so digits inside them are never taken for numbers.
_JSON_TOKEN = re.compile(
    r'("(?:[^"\\]|\\.)*")(\s*:)?'  # a string, then maybe the colon that makes it a key
    r"|(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"
    r"|\b(true|false|null)\b"
)
MIN_LAST_COLUMN = 20  # the last column is cut to the terminal's width, never below this


def colour_wanted(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """Colour only on a terminal, never with ``NO_COLOR`` set (to anything) or ``TERM=dumb``."""
    env = os.environ if env is None else env
    if "NO_COLOR" in env or env.get("TERM") == "dumb":
        return False
    return stream.isatty()


@dataclass(frozen=True)
class Output:
    """How one command prints: ``human`` on a terminal, ``colour`` when also wanted."""

    stream: TextIO
    human: bool
    colour: bool

    @classmethod
    def detect(cls, stream: TextIO | None = None) -> Output:
        stream = stream or sys.stdout
        human = stream.isatty()
        return cls(stream, human, human and colour_wanted(stream))

    def paint(self, text: str, style: str) -> str:
        if not self.colour or not text:
            return text
        return f"\x1b[{_STYLES[style]}m{text}{_RESET}"

    def write(self, text: str = "") -> None:
        self.stream.write(text + "\n")

    def width(self) -> int:
        return shutil.get_terminal_size((100, 24)).columns

    def unicode_ok(self) -> bool:
        """Whether the stream can print any character (else JSON keeps its ``\\u`` escapes)."""
        try:
            return codecs.lookup(self.stream.encoding or "ascii").name == "utf-8"
        except LookupError:
            return False


# -- indented JSON ------------------------------------------------------------------------


def _inert(char: str) -> str:
    """``char`` as a JSON escape (a surrogate pair above the BMP): still valid JSON, inert."""
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def readable_json(document: object, out: Output) -> str:
    """``document`` indented, with readable Unicode where the terminal can print it, every
    character a terminal would act on kept as an escape, and coloured tokens."""
    text = json.dumps(document, indent=2, ensure_ascii=not out.unicode_ok(), allow_nan=False)
    # json.dumps escapes C0 controls itself; C1 controls, bidi overrides, separators and lone
    # surrogates it would print raw. They can only occur inside strings, so escaping them
    # keeps the document valid JSON.
    text = "".join(_inert(c) if ord(c) > 0x7E and _is_unprintable(c) else c for c in text)
    if not out.colour:
        return text

    def paint(match: re.Match[str]) -> str:
        string, colon, number, literal = match.groups()
        if string is not None:
            return out.paint(string, "key") + colon if colon else out.paint(string, "ok")
        return out.paint(number or literal, "value")

    return _JSON_TOKEN.sub(paint, text)


def _is_unprintable(char: str) -> bool:
    # The audit table's rule for what a terminal acts on (the backslash aside: JSON keeps it).
    return char != "\\" and escape_cell(char) != char


# -- tables ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A column: ``width`` fixes it (streamed tables); 0 sizes it to its cells."""

    header: str
    width: int = 0


@dataclass(frozen=True)
class Cell:
    text: str
    style: str | None = None


def _cell(value: Cell | str) -> Cell:
    return value if isinstance(value, Cell) else Cell(value)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


class Table:
    """Rows printed under bold headers; the last column takes what is left of the line."""

    def __init__(self, out: Output, columns: Sequence[Column]) -> None:
        self._out = out
        self._columns = columns
        self._widths = [column.width for column in columns]

    def print(self, rows: Iterable[Sequence[Cell | str]]) -> None:
        """Size the columns to ``rows``, then print header and rows."""
        cells = [[_escaped(value) for value in row] for row in rows]
        for index, column in enumerate(self._columns[:-1]):
            if not column.width:
                self._widths[index] = max([len(column.header), *(len(row[index].text) for row in cells)])
        self.header()
        for row in cells:
            self._line(row)

    def header(self) -> None:
        self._line([Cell(column.header, "head") for column in self._columns])

    def row(self, values: Sequence[Cell | str]) -> None:
        """One more row of a streamed table (fixed widths)."""
        self._line([_escaped(value) for value in values])

    def _line(self, cells: Sequence[Cell]) -> None:
        parts = []
        used = 0
        for width, cell in zip(self._widths[:-1], cells[:-1], strict=True):
            text = _fit(cell.text, width).ljust(width)
            parts.append(self._out.paint(text, cell.style) if cell.style else text)
            used += width + 2
        last = cells[-1]
        # Piped, the reader is a program or a file: nothing is cut (there is no width to fit).
        room = max(self._out.width() - used, MIN_LAST_COLUMN) if self._out.human else len(last.text)
        text = _fit(last.text, room)
        parts.append(self._out.paint(text, last.style) if last.style else text)
        self._out.write("  ".join(parts).rstrip())


def _escaped(value: Cell | str) -> Cell:
    cell = _cell(value)
    return Cell(escape_cell(cell.text), cell.style)


# -- the commands' tables ----------------------------------------------------------------


def print_tools(tools: Sequence[Mapping[str, Any]], out: Output) -> None:
    """``runner list`` on a terminal."""
    columns = [Column("NAME"), Column("SANDBOX"), Column("TAGS"), Column("DESCRIPTION")]
    rows = [
        [
            Cell(tool["name"], "key"),
            tool["metadata"]["sandbox"],
            ", ".join(tool["metadata"]["tags"]) or "-",
            tool["description"],
        ]
        for tool in tools
    ]
    Table(out, columns).print(rows)
    out.write(out.paint(f"{len(tools)} tools", "dim"))


def print_layers(layers: Sequence[Layer], out: Output) -> None:
    """``runner doctor`` on a terminal: one row per layer, the hint under a missing one."""
    columns = [Column("STATUS"), Column("BACKEND"), Column("LAYER"), Column("DETAIL")]
    rows: list[list[Cell | str]] = []
    for layer in layers:
        status = Cell("ok", "ok") if layer.ok else Cell("MISSING", "bad")
        rows.append([status, layer.backend, layer.name, layer.detail])
        if not layer.ok and layer.hint:
            rows.append(["", "", "", Cell(f"-> {layer.hint}", "warn")])
    Table(out, columns).print(rows)


# Wide enough for a whole timestamp and a generated request id (req_ and 32 hex digits).
_AUDIT_WIDTHS = {"timestamp": 24, "event": 15, "requestId": 36, "toolName": 16, "role": 8, "outcome": 0}


def audit_table(out: Output) -> Table:
    """``runner audit`` on a terminal: fixed widths, so that ``--follow`` can stream rows."""
    return Table(out, [Column(name.upper(), _AUDIT_WIDTHS[name]) for name, _ in TABLE_COLUMNS])


def audit_row(event: dict[str, Any]) -> list[Cell | str]:
    cells: list[Cell | str] = [str(event.get(name) or "-") for name, _ in TABLE_COLUMNS[:-1]]
    failed = event.get("decision") == "deny" or event.get("success") is False or event.get("cancelled")
    style = "bad" if failed else "ok" if event.get("decision") == "allow" or event.get("success") else None
    cells.append(Cell(outcome(event), style))
    return cells


def _limits_text(limits: Mapping[str, Any]) -> str:
    return (
        f"timeout {limits['timeoutMs']} ms, memory {limits['memoryMb']} MB, cpu {limits['cpuSeconds']} s,"
        f" {limits['maxPids']} processes, output {limits['maxOutputBytes']} bytes,"
        f" scratch {limits['diskMb']} MB, network {'yes' if limits['network'] else 'no'}"
    )


def _calls_text(calls: Mapping[str, Any]) -> str:
    return f"{calls['retries']} retries {calls['retryDelayMs']} ms apart, deadline {calls['deadlineMs']} ms"


def _secrets_text(asks: Mapping[str, Any]) -> str:
    granted = set(asks["secretsGranted"])
    shown = [f"{name} ({'granted' if name in granted else 'NOT granted'})" for name in asks["secrets"]]
    return ", ".join(shown) or "-"


def _network_text(network: object) -> str:
    if network is True:
        return "yes"
    if network is False:
        return "no"
    allow = network.get("allow", []) if isinstance(network, dict) else []
    return "only " + ", ".join(str(entry) for entry in allow)


def print_tool_sheet(sheet: Mapping[str, Any], out: Output) -> None:
    """``runner show`` on a terminal: labelled lines, then the schemas as indented JSON."""
    meta = sheet["metadata"]
    asks = sheet["asks"]
    runs = sheet["runsIn"]
    limits = meta["limits"]
    roles = sheet["roles"]
    allowed = [role for role, verdict in roles.items() if verdict["allowed"]]
    denied = [f"{role} ({verdict['reason']})" for role, verdict in roles.items() if not verdict["allowed"]]
    where = runs["sandbox"] + (f", image {runs['image']}" if runs["image"] else "")
    where += f", runtime {runs['runtime']}" if runs["runtime"] else ""
    lines = [
        ("description", sheet["description"]),
        ("version", meta["version"] or "-"),
        ("tags", ", ".join(meta["tags"]) or "-"),
        ("sandbox", where),
        ("command", " ".join(sheet["command"])),
        ("folder", sheet["directory"]),
        ("limits", _limits_text(limits)),
        ("calls", _calls_text(sheet["calls"])),
        ("network", _network_text(asks["network"])),
        ("workspace", asks["workspace"]),
        ("secrets", _secrets_text(asks)),
        ("default role", sheet["defaultRole"] or "- (a call must name its role)"),
    ]
    out.write(out.paint(escape_cell(sheet["name"]), "head"))
    for label, value in lines:
        out.write(f"  {out.paint(label.ljust(13), 'dim')}{escape_cell(str(value))}")
    may_call = out.paint(escape_cell(", ".join(allowed)) or "no role", "ok")
    out.write(f"  {out.paint('may call'.ljust(13), 'dim')}{may_call}")
    if denied:
        may_not = out.paint(escape_cell(", ".join(denied)), "bad")
        out.write(f"  {out.paint('may not'.ljust(13), 'dim')}{may_not}")
    if (approval := sheet.get("approval")) is not None:
        held = f"{', '.join(approval['roles'])} (asked, waits up to {approval['timeoutMs']} ms)"
        out.write(f"  {out.paint('approval'.ljust(13), 'dim')}{escape_cell(held)}")
    for label, schema in (("params schema", sheet["paramsSchema"]), ("output schema", sheet["outputSchema"])):
        out.write(out.paint(label, "head"))
        out.write("  " + readable_json(schema, out).replace("\n", "\n  "))
