"""What a tool tells while it runs: its event lines read, checked, scrubbed and handed on.

A backend hands each event line of the tool's stderr to the attempt's ``ToolEvents``
(``sandboxes.events``) as it arrives. Each is one strict JSON object of one of three kinds:

- ``{"progress": N, "total": T, "message": M}`` (``total``, ``message`` optional);
- ``{"log": LEVEL, "data": ANY}`` at an MCP level;
- ``{"content": BLOCK}``: a text, image, audio or resource block attached to the answer.

Anything else (an unknown event, a malformed line, a number that is not finite, an image
of a type outside ``IMAGE_TYPES``, more than ``MAX_EVENTS``) is dropped and counted,
never a failure. Every string an event shows is scrubbed of the call's secrets. What
cannot be scrubbed in place is dropped: a progress number, or an image's, audio's or
blob's data, that holds a secret (as the base64 text, or in the bytes it decodes to; a
secret of fewer than ``MIN_DATA_SECRET`` characters is not looked for there).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import math
import re
from collections.abc import Callable
from typing import Any

from runner.schema import strict_json
from runner.schema.redaction import Scrubber

MAX_EVENTS = 1000
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
AUDIO_TYPES = frozenset({"audio/wav", "audio/mpeg", "audio/ogg", "audio/webm"})
# A resource's media type: type/subtype of RFC 6838's characters, at most 127 each.
MEDIA_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}")
# An event as the caller's ``on_event`` gets it: ``{"progress": ...}``, ``{"log": ...}``
# or ``{"content": ...}``.
Event = dict[str, Any]
EventListener = Callable[[Event], None]


class ToolEvents:
    """The events of one attempt: the ``EventSink`` its sandbox streams to.

    ``listener`` gets each event kept, as it arrives; ``content`` holds the blocks kept,
    ``ignored`` counts what was dropped."""

    def __init__(self, scrubber: Scrubber, listener: EventListener | None = None) -> None:
        self._scrubber = scrubber
        self._listener = listener
        self.content: list[dict[str, Any]] = []
        self.ignored_count = 0
        self._seen = 0
        self._last_progress = -math.inf

    def event(self, record: bytes) -> None:
        self._seen += 1
        event = self._read(record) if self._seen <= MAX_EVENTS else None
        if event is None:
            self.ignored_count += 1
            return
        if "content" in event:
            self.content.append(event["content"])
        if self._listener is not None:
            with contextlib.suppress(Exception):  # a listener's bug does not fail the tool's call
                self._listener(event)

    def ignored(self) -> None:
        self.ignored_count += 1

    def _read(self, record: bytes) -> Event | None:
        try:
            value = strict_json.loads(record)
        except strict_json.JsonProblem:
            return None
        if not isinstance(value, dict) or len(value.keys() & {"progress", "log", "content"}) != 1:
            return None
        if "progress" in value:
            return self._progress(value)
        if "log" in value:
            return self._log(value)
        block = _block(value["content"])
        if block is None or self._holds_secret(block):
            return None
        return {"content": self._scrubbed_block(block)}

    def _holds_secret(self, block: dict[str, Any]) -> bool:
        """Does an image's, audio's or blob's data hold a secret? It cannot be cut out of
        the data and leave it whole, so such a block is dropped."""
        data = block.get("data", block.get("resource", {}).get("blob"))
        return data is not None and self._scrubber.in_data(data)

    def _progress(self, value: dict[str, Any]) -> Event | None:
        done, total, message = value["progress"], value.get("total"), value.get("message")
        if not _number(done) or (total is not None and not (_number(total) and total > 0)):
            return None
        if message is not None and not isinstance(message, str):
            return None
        if self._scrubber.spelled_by(done) or self._scrubber.spelled_by(total):
            return None
        if total is not None:
            done = min(done, total)  # never past the whole
        if done <= self._last_progress:  # progress only goes forward
            return None
        self._last_progress = done
        event: Event = {"progress": done}
        if total is not None:
            event["total"] = total
        if message is not None:
            event["message"] = self._scrubber.scrub_text(message)
        return event

    def _log(self, value: dict[str, Any]) -> Event | None:
        level = value["log"]
        if level not in LOG_LEVELS:
            return None
        event: Event = {"log": level, "data": self._scrubber.scrub(value.get("data"), numbers=True)}
        logger = value.get("logger")
        if isinstance(logger, str):
            event["logger"] = self._scrubber.scrub_text(logger)
        return event

    def _scrubbed_block(self, block: dict[str, Any]) -> dict[str, Any]:
        scrub = self._scrubber.scrub_text
        if block["type"] == "text":
            return {"type": "text", "text": scrub(block["text"])}
        if block["type"] == "resource":
            body = dict(block["resource"])
            body["uri"] = scrub(body["uri"])
            if "mimeType" in body:
                body["mimeType"] = scrub(body["mimeType"])
            if "text" in body:
                body["text"] = scrub(body["text"])
            return {"type": "resource", "resource": body}
        return block


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _base64(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _block(block: object) -> dict[str, Any] | None:
    """A content block in its wire form (only the keys it may have), or None."""
    if not isinstance(block, dict):
        return None
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block["text"]} if isinstance(block.get("text"), str) else None
    if kind in ("image", "audio"):
        allowed = IMAGE_TYPES if kind == "image" else AUDIO_TYPES
        if block.get("mimeType") not in allowed or not _base64(block.get("data")):
            return None
        return {"type": kind, "mimeType": block["mimeType"], "data": block["data"]}
    if kind == "resource":
        body = _resource(block.get("resource"))
        return {"type": "resource", "resource": body} if body is not None else None
    return None


def _resource(body: object) -> dict[str, Any] | None:
    if not isinstance(body, dict) or not isinstance(body.get("uri"), str) or not body["uri"]:
        return None
    kept: dict[str, Any] = {"uri": body["uri"]}
    mime_type = body.get("mimeType")
    if mime_type is not None:
        # A media type's shape only: free text here would be a channel the scrub misses.
        if not isinstance(mime_type, str) or MEDIA_TYPE.fullmatch(mime_type) is None:
            return None
        kept["mimeType"] = mime_type
    text, blob = body.get("text"), body.get("blob")
    if isinstance(text, str) and blob is None:
        kept["text"] = text
    elif _base64(blob) and text is None:
        kept["blob"] = blob
    else:
        return None
    return kept
