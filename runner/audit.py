"""The audit trail: structlog events rendered as JSON lines, one append per event.

The processor chain is small callables, each taking and returning the event dict:
timestamp, bounding of every field, JSON rendering. The last link is a sink whose one
``os.write`` on an ``O_APPEND`` descriptor puts the whole line at the end of the file,
so several runner processes sharing one log never interleave partial lines.

The runner owns the structlog configuration of its process (``configure_structlog``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

from runner.redaction import NO_SECRETS, Scrubber

MAX_STRING = 512  # any string field is cut to this many characters
MAX_FIELD_JSON = 2048  # any container field is replaced by a cut JSON text past this size
MAX_LINE = 16 * 1024
# The fields that identify a call are never scrubbed: they are how ``runner audit`` finds it.
IDENTITY_FIELDS = frozenset({"event", "timestamp", "requestId", "traceId", "toolName", "role", "stepId"})


def iso_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def add_timestamp(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    event_dict.setdefault("timestamp", iso_now())
    return event_dict


def _bound(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + "...(cut)"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # strict JSON has no NaN or Infinity
    if value is None or isinstance(value, bool | int | float):
        return value
    try:
        text = json.dumps(value, default=str, ensure_ascii=True, allow_nan=False)
    except (ValueError, RecursionError):
        return "<unserializable>"
    if len(text) <= MAX_FIELD_JSON:
        return json.loads(text)
    return text[:MAX_FIELD_JSON] + "...(cut)"


def bound_fields(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    return {key: _bound(value) for key, value in event_dict.items()}


def render_line(_: WrappedLogger, __: str, event_dict: EventDict) -> str:
    # ensure_ascii: control characters and line separators from a request are escaped,
    # so a value can never end the line or start a forged event.
    line = json.dumps(event_dict, default=str, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    if len(line) > MAX_LINE:
        line = json.dumps(
            {k: event_dict.get(k) for k in ("timestamp", "event", "requestId", "traceId")}
            | {"truncated": True},
            default=str,
            ensure_ascii=True,
            allow_nan=False,
        )
    return line


class AuditSink:
    """Where rendered lines go: a file opened for appending, or standard error."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def msg(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        fd = self._fd if self._fd is not None else sys.stderr.fileno()
        with self._lock, contextlib.suppress(OSError):
            os.write(fd, data)

    info = msg  # structlog calls the wrapped logger's method of the same level

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _sink_factory(*args: Any) -> Any:
    # ``structlog.get_logger(sink)`` hands the sink through to here.
    return args[0] if args else AuditSink(None)


@functools.cache  # once per process (a racing second call would only configure the same again)
def configure_structlog() -> None:
    structlog.configure(
        processors=[add_timestamp, bound_fields, render_line],
        logger_factory=_sink_factory,
        wrapper_class=structlog.BoundLogger,
        cache_logger_on_first_use=False,
    )


class AuditLog:
    """Writes the audit events of calls. ``emit`` never raises."""

    def __init__(self, path: Path | None) -> None:
        configure_structlog()
        self.sink = AuditSink(path)

    def emit(self, event: str, scrubber: Scrubber = NO_SECRETS, **fields: Any) -> None:
        """Write one event; every field but the call's ids is scrubbed of ``scrubber``'s secrets."""
        logger = structlog.get_logger(self.sink)
        with contextlib.suppress(Exception):  # the audit trail never breaks a call
            if scrubber:
                fields = {
                    key: value if key in IDENTITY_FIELDS else scrubber.scrub(value)
                    for key, value in fields.items()
                }
            logger.info(event, **fields)

    def close(self) -> None:
        self.sink.close()
