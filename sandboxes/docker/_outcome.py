"""How a container's run ended, told from its final state (or the gate's trailer), the
limits its cgroup saw broken and the exec guard's token (``sandboxes._exec_status``)."""

from __future__ import annotations

import signal
from typing import Any

from sandboxes._exec_status import exec_failure
from sandboxes._kernel import signal_from_init_status
from sandboxes.base import SandboxOutcome, StopReason
from sandboxes.events import StderrSplitter


def outcome(
    state: dict[str, Any],
    reason: StopReason | None,
    stdout: bytes,
    stderr: StderrSplitter,
    token: str,
    duration_ms: float,
    zero_fails: bool = False,
) -> SandboxOutcome:
    """The outcome the container's final ``state`` tells; with ``zero_fails`` (a dialogue's
    tool, which should have run until the dialogue's end) even an exit 0 is ``exit_code``."""
    exit_code: int | None = state.get("ExitCode")
    sig: int | None = None
    stderr_tail = stderr.text()
    message = ""
    if reason is None:
        if state.get("OOMKilled"):
            reason = StopReason.MEMORY_LIMIT
        elif exit_code is None or state.get("Running"):
            reason = StopReason.SANDBOX_UNAVAILABLE
        elif exit_code != 0 or zero_fails:
            reason = StopReason.EXIT_CODE
            sig = signal_from_init_status(exit_code)  # Docker's init: 128 + N
            if sig is not None:
                exit_code = None
                reason = StopReason.CPU_LIMIT if sig == signal.SIGXCPU else StopReason.SIGNAL
            elif (failure := exec_failure(exit_code, stderr_tail, token)) is not None:
                reason, message, stderr_tail = StopReason.NOT_EXECUTABLE, failure.why, failure.stderr_tail
    if reason is StopReason.SANDBOX_UNAVAILABLE:
        message = "the container did not report an exit status"
    return SandboxOutcome(
        exit_code=exit_code,
        signal=sig,
        stdout=stdout if reason is not StopReason.OUTPUT_LIMIT else b"",
        stderr_tail=stderr_tail,
        duration_ms=duration_ms,
        reason=reason,
        message=message,
    )
