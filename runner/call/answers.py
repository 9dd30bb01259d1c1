"""The answer shell as typed values; the wire dict is made from them at the edge only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.errors import CallError, ErrorCode


@dataclass(frozen=True)
class AnswerMetadata:
    duration: int
    attempts: int
    tool_name: str | None
    timestamp: str
    request_id: str
    trace_id: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "duration": self.duration,
            "attempts": self.attempts,
            "toolName": self.tool_name,
            "timestamp": self.timestamp,
            "requestId": self.request_id,
            "traceId": self.trace_id,
            **self.extra,
        }


@dataclass(frozen=True)
class ErrorInfo:
    code: ErrorCode
    message: str
    details: dict[str, Any]
    retryable: bool

    @classmethod
    def of(cls, error: CallError) -> ErrorInfo:
        return cls(error.code, error.message, error.details, error.retryable)

    def to_wire(self) -> dict[str, Any]:
        return {
            "code": self.code.value,
            "message": self.message,
            "details": self.details,
            "retryable": self.retryable,
        }


@dataclass(frozen=True)
class CallResult:
    """What ``Runner.call`` returns: the answer shell as typed values."""

    success: bool
    result: Any
    error: ErrorInfo | None
    metadata: AnswerMetadata
    # The content blocks the tool attached (text, image, audio, resource), in order.
    content: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(
        cls,
        result: Any,
        error: CallError | None,
        metadata: AnswerMetadata,
        content: tuple[dict[str, Any], ...] = (),
    ) -> CallResult:
        """The answer of a call: ``result`` (and ``content``) when ``error`` is None, else the error."""
        if error is not None:
            return cls(False, None, ErrorInfo.of(error), metadata)
        return cls(True, result, None, metadata, content)

    def to_wire(self) -> dict[str, Any]:
        """The answer shell of the wire format (docs/calls.md), camelCase; ``content`` only
        when the tool attached any."""
        wire = {
            "success": self.success,
            "result": self.result,
            "error": self.error.to_wire() if self.error is not None else None,
            "metadata": self.metadata.to_wire(),
        }
        if self.content:
            wire["content"] = list(self.content)
        return wire
