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


class EventLines:
    """Each progress and log event as one line on ``stream`` (a terminal), as it comes."""

    def __init__(self, stream: TextIO, tool_name: str) -> None:
        self._stream = stream
        self._tool = tool_name

    def __call__(self, event: dict[str, Any]) -> None:
        if "progress" in event:
            total = event.get("total")
            done = f"{event['progress']:g}/{total:g}" if total is not None else f"{event['progress']:g}"
            line = f"{self._tool}: {done} {event.get('message') or ''}".rstrip()
        elif "log" in event:
            data = event["data"]
            text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            line = f"{self._tool} [{event['log']}] {text}"
        else:
            return
        self._stream.write(_printable(line) + "\n")
        self._stream.flush()


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
