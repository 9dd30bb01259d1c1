"""The answer shell, as a wire dict and as typed values for the Python API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.errors import CallError


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
    code: str
    message: str
    details: dict[str, Any]
    retryable: bool


@dataclass(frozen=True)
class CallResult:
    """What ``Runner.call`` returns: the answer shell as typed values."""

    success: bool
    result: Any
    error: ErrorInfo | None
    metadata: AnswerMetadata

    @classmethod
    def from_wire(cls, answer: dict[str, Any]) -> CallResult:
        meta = dict(answer["metadata"])
        metadata = AnswerMetadata(
            duration=meta.pop("duration"),
            attempts=meta.pop("attempts"),
            tool_name=meta.pop("toolName"),
            timestamp=meta.pop("timestamp"),
            request_id=meta.pop("requestId"),
            trace_id=meta.pop("traceId"),
            extra=meta,
        )
        error = ErrorInfo(**answer["error"]) if answer["error"] else None
        return cls(answer["success"], answer["result"], error, metadata)


def answer(result: Any, error: CallError | None, metadata: AnswerMetadata) -> dict[str, Any]:
    return {
        "success": error is None,
        "result": None if error is not None else result,
        "error": error.to_wire() if error is not None else None,
        "metadata": metadata.to_wire(),
    }
