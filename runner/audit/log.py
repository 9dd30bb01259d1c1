"""The audit trail: structlog events rendered as JSON lines, one append per event.

The processor chain is small callables, each taking and returning the event dict:
timestamp, bounding of every field, JSON rendering. The last link is a sink whose one
``os.write`` on an ``O_APPEND`` descriptor puts the whole line at the end of the file,
so several runner processes sharing one log never interleave partial lines.

The logger is the runner's own (``structlog.wrap_logger`` with every setting given), so
a host application's ``structlog.configure``, before or after the runner loads, changes
neither the audit trail nor is changed by it: the runner never calls ``configure``.
Tests inject a sink (``AuditLog.captured``) instead of ``structlog.testing.capture_logs``.

An event that cannot be written is never dropped silently: it is counted
(``AuditLog.dropped``) and warned about on standard error (at most a line a second). With
``required``, a call whose ``policy.decision`` cannot be written is refused before
anything runs (``EXECUTION_ERROR``, reason ``audit_unavailable``).

With ``chain`` each line also carries ``prevHash`` and ``hash`` (``runner.audit.chain``):
the file sink then takes an exclusive ``flock`` per line (on a private lock file beside the
log), and nothing else changes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from runner.audit import chain as audit_chain
from runner.audit.chain import ChainedFileSink
from runner.audit.faults import OperatorLog
from runner.audit.files import open_log_file
from runner.clock import iso_now
from runner.errors import CallError, ErrorCode
from runner.schema.redaction import NO_SECRETS, Scrubber

MAX_STRING = 512  # any string field is cut to this many characters
MAX_FIELD_JSON = 2048  # any container field is replaced by a cut JSON text past this size
MAX_LINE = 16 * 1024
# The fields that identify a call are never scrubbed: they are how ``runner audit`` finds it.
IDENTITY_FIELDS = frozenset(
    {"event", "timestamp", "requestId", "traceId", "toolName", "role", "stepId", "sessionId"}
)
# Written before anything of a call runs: under ``required``, a call whose decision is not
# on record does not run.
GATE_EVENTS = frozenset({"policy.decision"})
AUDIT_UNAVAILABLE = "audit_unavailable"
DROP_WARNING_INTERVAL_S = 1.0  # at most one warning line a second about events not written
# The client a call is served for (`runner serve --http`: its token's name). The server sets
# it around each call; every event written in that context carries it as `client`.
AUDIT_CLIENT: ContextVar[str | None] = ContextVar("runner_audit_client", default=None)
# The session a call is served in (``runner.call.sessions``): its events carry it as `sessionId`.
AUDIT_SESSION: ContextVar[str | None] = ContextVar("runner_audit_session", default=None)


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
        line = json.dumps(_stub(event_dict), default=str, ensure_ascii=True, allow_nan=False)
    return line


def _stub(event_dict: EventDict) -> dict[str, Any]:
    """What is left of an event whose line would pass ``MAX_LINE``."""
    return {k: event_dict.get(k) for k in ("timestamp", "event", "requestId", "traceId")} | {
        "truncated": True
    }


def render_for_chain(_: WrappedLogger, __: str, event_dict: EventDict) -> str:
    """The event as ``audit_chain.prepare`` makes it, for ``ChainedFileSink`` (whose lock
    then covers only the hashing); the same bound on length as ``render_line``."""
    prepared = audit_chain.prepare(event_dict)
    if len(prepared) > MAX_LINE:
        prepared = audit_chain.prepare(_stub(event_dict))
    return prepared


PROCESSORS: tuple[Processor, ...] = (add_timestamp, bound_fields, render_line)
CHAIN_PROCESSORS: tuple[Processor, ...] = (add_timestamp, bound_fields, render_for_chain)


class LineSink(Protocol):
    """Where rendered lines go."""

    def write(self, line: str) -> None:
        """Append one whole line (given without its newline).

        Raises:
            OSError: the line was not written whole.
        """

    def close(self) -> None: ...


class FileSink:
    """A file opened for appending; each line is one ``os.write``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = open_log_file(path, os.O_WRONLY | os.O_APPEND, "the audit log")

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise OSError(9, "the audit log is closed")
            written = os.write(self._fd, data)
        if written != len(data):  # a full disk can take part of a line: that line is lost
            raise OSError(28, f"only {written} of {len(data)} bytes written")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _file_sink(path: Path, chain: bool, key: bytes | None) -> LineSink:
    return ChainedFileSink(path, key) if chain else FileSink(path)


class StderrSink:
    """Standard error (file descriptor 2, one ``os.write`` per line), when no file is set."""

    path = None

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        written = os.write(sys.stderr.fileno(), data)
        if written != len(data):
            raise OSError(28, f"only {written} of {len(data)} bytes written")

    def close(self) -> None:
        pass


class MemorySink:
    """Keeps the events it is given, parsed back from their lines (for tests)."""

    path = None

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def write(self, line: str) -> None:
        self.events.append(json.loads(line))

    def close(self) -> None:
        pass


class _LineLogger:
    """What structlog wraps: the last processor's line goes to ``sink``."""

    def __init__(self, sink: LineSink) -> None:
        self.sink = sink

    def info(self, line: str) -> None:  # structlog calls the method of the event's level
        self.sink.write(line)


def _own_logger(sink: LineSink) -> Any:
    # Every setting given: none is read from structlog's global configuration.
    processors = CHAIN_PROCESSORS if isinstance(sink, ChainedFileSink) else PROCESSORS
    return structlog.wrap_logger(
        _LineLogger(sink),
        processors=list(processors),
        wrapper_class=structlog.BoundLogger,
        context_class=dict,
        cache_logger_on_first_use=True,
    )


class AuditLog:
    """Writes the audit events of calls.

    ``emit`` never raises, except under ``required`` for a gate event (``policy.decision``)
    that could not be written: then ``CallError`` (``EXECUTION_ERROR``, reason
    ``audit_unavailable``, not retryable), so that the call is refused.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        sink: LineSink | None = None,
        required: bool = False,
        chain: bool = False,
        key: bytes | None = None,
        operator: OperatorLog | None = None,
    ) -> None:
        """With ``chain``, events written to ``path`` are hash-chained (``sink`` is used as given),
        with ``key`` by HMAC-SHA256.

        Raises:
            OSError: ``path`` cannot be opened for appending (with ``chain``: also when it is a
                symlink or not a regular file).
            ValueError: ``chain`` without ``path`` or ``sink``: standard error cannot be chained;
                ``key`` without ``chain``.
        """
        if chain and path is None and sink is None:
            raise ValueError("a hash-chained audit trail needs a file")
        if key is not None and not chain:
            raise ValueError("a key is for a hash-chained audit trail")
        self._sink: LineSink = (
            sink if sink is not None else _file_sink(path, chain, key) if path else StderrSink()
        )
        self.path = path
        self.required = required
        self.operator = operator or OperatorLog()
        self._logger = _own_logger(self._sink)
        self._lock = threading.Lock()
        self._dropped = 0
        self._unwarned = 0  # drops not yet in a warning
        self._warned_at: float | None = None
        if isinstance(self._sink, ChainedFileSink) and self._sink.tail_matches() is False:
            how = "with audit.key" if key is not None else "as unkeyed SHA-256"
            self.operator.warn(
                f"the last line of the audit log {path} does not verify {how}: the key was set, "
                "changed or removed since it was written, or the line was edited; runner audit "
                "verify will name the lines before as changed: start a new log file when the key changes"
            )

    @property
    def sink(self) -> LineSink:
        return self._sink

    @property
    def dropped(self) -> int:
        """How many events could not be written."""
        return self._dropped

    def emit(self, event: str, scrubber: Scrubber = NO_SECRETS, **fields: Any) -> None:
        """Write one event; every field but the call's ids is scrubbed of ``scrubber``'s secrets.

        Raises:
            CallError: only with ``required``, for a gate event that was not written.
        """
        try:
            client = AUDIT_CLIENT.get()
            if client is not None:
                fields["client"] = client
            session = AUDIT_SESSION.get()
            if session is not None and "sessionId" not in fields:
                fields["sessionId"] = session
            if scrubber:
                fields = {
                    key: value if key in IDENTITY_FIELDS else scrubber.scrub(value)
                    for key, value in fields.items()
                }
            self._logger.info(event, **fields)
        except Exception as exc:  # never silent: counted, warned, and a gate refuses
            self._count_drop(event, exc)
            if self.required and event in GATE_EVENTS:
                raise CallError(
                    ErrorCode.EXECUTION_ERROR,
                    "the audit trail cannot be written and the policy requires it; the call was refused",
                    {"reason": AUDIT_UNAVAILABLE},
                    retryable=False,
                ) from exc

    def _count_drop(self, event: str, exc: Exception) -> None:
        # Every drop is warned about, at most one line a second (a stuck lock or a full disk
        # drops every event: a line each would flood the operator log), with the count since.
        now = time.monotonic()
        with self._lock:
            self._dropped += 1
            self._unwarned += 1
            if self._warned_at is not None and now - self._warned_at < DROP_WARNING_INTERVAL_S:
                return
            self._warned_at, count, self._unwarned = now, self._unwarned, 0
            total = self._dropped
        where = str(self.path) if self.path is not None else "the audit sink"
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        also = f" (and {count - 1} more since the last warning)" if count > 1 else ""
        self.operator.warn(
            f"audit event {event!r} could not be written to {where} ({why}){also}; "
            f"{total} event(s) not written so far (Runner.audit.dropped); "
            f"warned at most once a second"
        )
        if not isinstance(exc, OSError):  # not the disk: a fault of the runner's own
            self.operator.fault(exc, event=event)

    @contextlib.contextmanager
    def captured(self) -> Iterator[list[dict[str, Any]]]:
        """Send the events to memory while the block runs, and yield them (for tests; the
        file is left alone). Not for use while other calls are running."""
        sink = MemorySink()
        previous = self._sink, self._logger
        self._sink, self._logger = sink, _own_logger(sink)
        try:
            yield sink.events
        finally:
            self._sink, self._logger = previous

    def close(self) -> None:
        self._sink.close()
        self.operator.close()
