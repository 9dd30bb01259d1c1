"""Errors of the runner, and the one table of wire error codes.

    RunnerError                 root; carries ``code`` and structured ``details``
    ├── ConfigError             a policy file or tool directory that cannot be used (CLI exit 2)
    └── CallError               a call that failed; becomes the wire ``error`` object
        ├── code TOOL_NOT_FOUND, PERMISSION_DENIED, INVALID_PARAMS, CIRCUIT_OPEN
        └── code TIMEOUT, EXECUTION_ERROR, PARSE_ERROR, RETRY_EXHAUSTED

Lower-level failures (sandbox outcomes, pydantic and jsonschema errors) are translated
into a ``CallError`` at one boundary each, never by matching message text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class ErrorCode(enum.StrEnum):
    TOOL_NOT_FOUND = "TOOL_NOT_FOUND"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INVALID_PARAMS = "INVALID_PARAMS"
    CIRCUIT_OPEN = "CIRCUIT_OPEN"
    TIMEOUT = "TIMEOUT"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    PARSE_ERROR = "PARSE_ERROR"
    RETRY_EXHAUSTED = "RETRY_EXHAUSTED"


@dataclass(frozen=True)
class CodeRule:
    retried: bool  # does the executor try again after an attempt failed this way
    retryable: bool  # what the wire tells the caller about coming back later
    counted: bool  # does the circuit breaker hold it against the tool


CODE_RULES: dict[ErrorCode, CodeRule] = {
    ErrorCode.TOOL_NOT_FOUND: CodeRule(retried=False, retryable=False, counted=False),
    ErrorCode.PERMISSION_DENIED: CodeRule(retried=False, retryable=False, counted=False),
    ErrorCode.INVALID_PARAMS: CodeRule(retried=False, retryable=False, counted=False),
    ErrorCode.CIRCUIT_OPEN: CodeRule(retried=False, retryable=True, counted=False),
    ErrorCode.TIMEOUT: CodeRule(retried=True, retryable=True, counted=True),
    ErrorCode.EXECUTION_ERROR: CodeRule(retried=True, retryable=True, counted=True),
    ErrorCode.PARSE_ERROR: CodeRule(retried=False, retryable=False, counted=True),
    ErrorCode.RETRY_EXHAUSTED: CodeRule(retried=False, retryable=True, counted=True),
}

# EXECUTION_ERROR by reason. A plain failure may be a flake; the same input
# breaks the same limit again, a program that cannot be started stays so, a missing
# secret or sandbox is the host's to fix, and a runner fault is the operator's. A
# ``tool_error`` is retried exactly when the tool said ``retryable: true`` (the error
# is built with the tool's word). A reason not listed follows the code's rule. Not
# counted by the breaker: what says nothing of the tool's health (it reported an error
# of its own, or it never ran: no secret, no sandbox, no audit trail, a runner fault).
REASON_RULES: dict[str, CodeRule] = {
    "exit_code": CodeRule(retried=True, retryable=True, counted=True),
    "signal": CodeRule(retried=True, retryable=True, counted=True),
    "tool_error": CodeRule(retried=False, retryable=False, counted=False),
    "memory_limit": CodeRule(retried=False, retryable=False, counted=True),
    "cpu_limit": CodeRule(retried=False, retryable=False, counted=True),
    "pids_limit": CodeRule(retried=False, retryable=False, counted=True),
    "output_limit": CodeRule(retried=False, retryable=False, counted=True),
    "not_executable": CodeRule(retried=False, retryable=False, counted=True),
    "secret_unavailable": CodeRule(retried=False, retryable=False, counted=False),
    "sandbox_unavailable": CodeRule(retried=False, retryable=False, counted=False),
    "internal": CodeRule(retried=False, retryable=False, counted=False),
    # A dispatched attempt whose cluster node died under it: retried, most likely
    # on another node; not counted, as a dead node says nothing of the tool's health.
    "node_lost": CodeRule(retried=True, retryable=True, counted=False),
    # The tool ran but its staged workspace writes could not all be applied (the
    # workspace's disk, its modes): the host's to fix, and a retry would run the tool
    # again over writes half applied.
    "workspace_not_applied": CodeRule(retried=False, retryable=False, counted=False),
    # audit.required and the trail cannot be written: refused before any attempt.
    "audit_unavailable": CodeRule(retried=False, retryable=False, counted=False),
}


def rule_of(code: ErrorCode, reason: str | None) -> CodeRule:
    """What the table says of an error with this code and ``details.reason``."""
    if code is ErrorCode.EXECUTION_ERROR and reason in REASON_RULES:
        return REASON_RULES[reason]
    return CODE_RULES[code]


class RunnerError(Exception):
    """Root of every error the runner raises on purpose."""


class ConfigError(RunnerError):
    """A configuration that cannot be used; ``source`` names the file."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


class CallError(RunnerError):
    """A failed call, with everything the wire error object needs."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        details: dict[str, Any] | None = None,
        *,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = " ".join(message.split())  # messages are single-line by contract
        self.details = details or {}
        reason = self.details.get("reason")
        rule = rule_of(code, reason if isinstance(reason, str) else None)
        self.retryable = rule.retryable if retryable is None else retryable

    @property
    def reason(self) -> str | None:
        reason = self.details.get("reason")
        return reason if isinstance(reason, str) else None

    @property
    def retried(self) -> bool:
        """Does the executor try again? Only what the caller, too, may sensibly try
        again, and of that only a failed attempt (not a refusal or an exhausted call)."""
        return CODE_RULES[self.code].retried and self.retryable

    def to_wire(self) -> dict[str, Any]:
        return {
            "code": self.code.value,
            "message": self.message,
            "details": self.details,
            "retryable": self.retryable,
        }
