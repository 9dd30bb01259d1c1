"""The one boundary where a sandbox outcome becomes a result or a ``CallError``."""

from __future__ import annotations

import re
import signal as signals
from typing import Any, Literal

from runner.errors import CallError, ErrorCode
from runner.schema import strict_json
from runner.tools.manifest import Tool
from runner.tools.tool_errors import NotAReport, ToolReport, one_line, read_report
from sandboxes import SandboxOutcome, StopReason

MAX_STDERR_TAIL = 2000

_REASON_TEXT = {
    StopReason.EXIT_CODE: "exited with status {exit_code}",
    StopReason.SIGNAL: "was killed by signal {signal_name}",
    StopReason.MEMORY_LIMIT: "was killed for exceeding its memory limit",
    StopReason.CPU_LIMIT: "was killed for exceeding its CPU time limit",
    StopReason.PIDS_LIMIT: "hit its process limit",
    StopReason.OUTPUT_LIMIT: "was killed for writing more than its output limit",
    StopReason.NOT_EXECUTABLE: "could not be started: {program}: {message}",
    StopReason.SANDBOX_UNAVAILABLE: "could not be started: {message}",
    StopReason.NODE_LOST: "lost the cluster node it ran on: {message}",
    StopReason.WORKSPACE_NOT_APPLIED: "ran, but {message}",
}


# A path starts a word (``runner/base:latest`` names an image, not a path in ``/base``).
_HOST_PATH = re.compile(r"(?<![\w.-])/[^\s:'\"]+")


def mask_host_paths(text: str) -> str:
    """Error messages never show host paths; a sandbox's complaint may name some."""
    return _HOST_PATH.sub("<path>", text)


def _signal_name(number: int | None) -> str:
    if number is None:
        return "?"
    try:
        return signals.Signals(number).name
    except ValueError:
        return str(number)


def failure_error(tool: Tool, outcome: SandboxOutcome, timeout_ms: int, by_deadline: bool) -> CallError:
    """The error of an attempt that did not end with a clean exit."""
    reason = outcome.reason
    assert reason is not None
    if reason is StopReason.TIMEOUT:
        what = (
            "did not finish before the call's deadline"
            if by_deadline
            else f"did not finish within its timeout of {timeout_ms} ms"
        )
        return CallError(
            ErrorCode.TIMEOUT,
            f"{tool.name} {what}, so it was killed",
            {
                "timeoutMs": timeout_ms,
                "deadline": by_deadline,
                "stderr": outcome.stderr_tail[-MAX_STDERR_TAIL:],
            },
        )
    details: dict[str, Any] = {
        "exitCode": outcome.exit_code,
        "signal": _signal_name(outcome.signal) if outcome.signal else None,
        "reason": reason.value,
        "stderr": outcome.stderr_tail[-MAX_STDERR_TAIL:],
    }
    report = read_report(outcome.stdout) if reason is StopReason.EXIT_CODE else None
    if isinstance(report, ToolReport):
        return _tool_error(report, details)
    if isinstance(report, NotAReport):
        details["errorDocument"] = report.problem  # why this is not a tool_error
    text = _REASON_TEXT[reason].format(
        exit_code=outcome.exit_code,
        signal_name=_signal_name(outcome.signal),
        program=mask_host_paths(tool.manifest.command[0]),
        message=mask_host_paths(outcome.message),
    )
    return CallError(ErrorCode.EXECUTION_ERROR, f"{tool.name} {text}", details)


def _tool_error(report: ToolReport, details: dict[str, Any]) -> CallError:
    """The tool's own error: its message, code and details; retried only on its word."""
    details = {
        **details,
        "reason": "tool_error",
        "toolCode": report.code,
        "toolDetails": report.details,
    }
    if report.details_omitted is not None:
        details["toolDetailsOmitted"] = report.details_omitted
    return CallError(ErrorCode.EXECUTION_ERROR, report.message, details, retryable=report.retryable)


def parse_result(tool: Tool, stdout: bytes, output_format: Literal["json", "raw"]) -> Any:
    """The result of a clean exit.

    Raises:
        CallError: PARSE_ERROR when stdout is not one strict JSON document (no NaN or
            Infinity, at most ``strict_json.MAX_DEPTH`` levels) or fails ``output_schema``.
    """
    if output_format == "raw":
        return stdout.decode("utf-8", errors="replace")
    try:
        result = strict_json.loads(stdout)
    except strict_json.JsonProblem as exc:
        # Strict: NaN, Infinity, numbers overflowing to infinity and documents nested
        # deeper than the runner handles are parse errors of the tool, like any bad JSON.
        preview = stdout[:120].decode("utf-8", errors="replace")
        raise CallError(
            ErrorCode.PARSE_ERROR,
            f"{tool.name} did not print one JSON document on stdout",
            {"problem": one_line(str(exc), 200), "stdoutPreview": preview},
        ) from exc
    if tool.output_validator is not None:
        from runner.schema.compiled import first_error  # jsonschema: only for a tool with an output_schema

        problem = first_error(tool.output_validator, result)
        if problem is not None:
            raise CallError(
                ErrorCode.PARSE_ERROR,
                f"{tool.name} returned a result that does not match its output_schema",
                problem,
            )
    return result
