"""``runner exec``'s side of a tool's events: progress and log lines on a terminal's
stderr while the tool runs, and the answer's content blocks written to files."""

from __future__ import annotations

import base64
import binascii
import json
import sys
from pathlib import Path
from typing import Any, TextIO

# The file name's extension of each media type a block may have.
EXTENSIONS = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/gif": "gif",
    "image/webp": "webp",
    "audio/wav": "wav",
    "audio/mpeg": "mp3",
    "audio/ogg": "ogg",
    "audio/webm": "webm",
}


# The width of the progress bar, in characters.
BAR_WIDTH = 24
# Back to the start of the line, and erase it: the bar is redrawn in place.
REDRAW = "\r\x1b[K"


class EventLines:
    """The tool's progress as a bar redrawn in place on ``stream`` (a terminal), its log
    events as lines above the bar, as they come; ``close`` ends the bar's line."""

    def __init__(self, stream: TextIO, tool_name: str) -> None:
        self._stream = stream
        self._tool = tool_name
        self._bar = ""  # the bar on screen, if any

    def __call__(self, event: dict[str, Any]) -> None:
        if "progress" in event:
            self._bar = _printable(self._bar_of(event))
            self._stream.write(REDRAW + self._bar)
        elif "log" in event:
            data = event["data"]
            text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            line = _printable(f"{self._tool} [{event['log']}] {text}")
            self._stream.write(REDRAW + line + "\n" + self._bar)
        else:
            return
        self._stream.flush()

    def close(self) -> None:
        if self._bar:
            self._stream.write("\n")
            self._stream.flush()
            self._bar = ""

    def _bar_of(self, event: dict[str, Any]) -> str:
        done, total, message = event["progress"], event.get("total"), event.get("message") or ""
        if total is None:
            return f"{self._tool}: {done:g} {message}".rstrip()
        filled = round(BAR_WIDTH * min(done, total) / total)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return f"{self._tool}: [{bar}] {done:g}/{total:g} {message}".rstrip()


def _printable(text: str) -> str:
    """A tool's text without control characters: it cannot move the terminal's cursor."""
    return "".join(char if char.isprintable() else "?" for char in text)


def save_content(blocks: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Write each block to a file of its own in ``folder`` (made if need be):
    ``01-text.txt``, ``02-image.png``, ``03-resource.txt``...; the paths written.

    Raises:
        OSError: the folder or a file cannot be written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for number, block in enumerate(blocks, 1):
        kind = block["type"]
        data: bytes
        if kind == "text":
            extension, data = "txt", block["text"].encode()
        elif kind == "resource":
            body = block["resource"]
            text = body.get("text")
            extension, data = ("txt", text.encode()) if text is not None else ("bin", _decoded(body["blob"]))
        else:
            extension, data = EXTENSIONS.get(block["mimeType"], "bin"), _decoded(block["data"])
        path = folder / f"{number:02d}-{kind}.{extension}"
        path.write_bytes(data)
        written.append(path)
    return written


def _decoded(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):  # checked by the runner; never expected here
        return b""


def terminal_events(tool_name: str) -> EventLines | None:
    """The event printer when stderr is a terminal; None when it is piped."""
    return EventLines(sys.stderr, tool_name) if sys.stderr.isatty() else None
