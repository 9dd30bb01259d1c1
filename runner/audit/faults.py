"""Faults of the runner itself: the operator log, and what a caller is told.

A bug in the runner answers ``EXECUTION_ERROR`` reason ``internal`` with the exception's
type name only; its traceback goes to the operator log (standard error, or the policy's
``audit.operator_log``), never to the caller: a traceback quotes code, paths and values.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from runner.audit.files import open_log_file
from runner.clock import iso_now
from runner.errors import CallError, ConfigError, ErrorCode
from runner.schema.redaction import NO_SECRETS, Scrubber


def internal_error(exc: BaseException) -> CallError:
    """The answer to a fault of the runner: not retryable, and no text of the exception."""
    return CallError(
        ErrorCode.EXECUTION_ERROR,
        f"internal error in the runner: {type(exc).__name__}",
        {"reason": "internal"},
        retryable=False,
    )


class OperatorLog:
    """Text for the runner's operator: fault tracebacks and warnings.

    Each entry is one ``os.write`` on an ``O_APPEND`` descriptor, so entries of several
    runner processes sharing the file never interleave. Writing never raises.
    """

    def __init__(self, fd: int | None = None, path: Path | None = None) -> None:
        self.path = path
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path | None) -> OperatorLog:
        """The operator log at ``path``, or standard error when it is None.

        Raises:
            ConfigError: the file cannot be opened for appending.
        """
        if path is None:
            return cls()
        try:
            fd = open_log_file(path, os.O_WRONLY | os.O_APPEND, "the operator log")
        except OSError as exc:
            raise ConfigError(str(path), f"cannot open the operator log: {exc.strerror}") from exc
        return cls(fd, path)

    def fault(self, exc: BaseException, scrubber: Scrubber = NO_SECRETS, **ids: Any) -> None:
        """Write a runner fault with its traceback; the call's secrets are cut out of it."""
        try:
            trace = "".join(traceback.format_exception(exc))
        except Exception as problem:  # a traceback that cannot be formatted
            trace = f"{type(exc).__name__} (traceback unavailable: {type(problem).__name__})\n"
        where = " ".join(f"{key}={value!r}" for key, value in ids.items())
        text = f"{iso_now()} runner: internal error {where}\n{trace}"
        self.write(scrubber.scrub_text(text) if scrubber else text)

    def warn(self, message: str) -> None:
        """A one-line warning, on standard error, and in the operator's file when there is one."""
        line = f"runner: warning: {' '.join(message.split())}\n"
        if self._fd is not None:
            self.write(f"{iso_now()} {line}")
        _to_stderr(line)

    def write(self, text: str) -> None:
        if self._fd is None:
            _to_stderr(text)
            return
        with self._lock:
            try:
                os.write(self._fd, text.encode("utf-8", errors="replace"))
            except OSError:
                _to_stderr(text)  # the operator's file failed: standard error is the last resort

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _to_stderr(text: str) -> None:
    # sys.stderr, not fd 2: a host application (a notebook) may have replaced it.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(text)
        sys.stderr.flush()
