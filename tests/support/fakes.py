"""An in-memory sandbox and a manual clock, for the executor's own logic.

Never a substitute for a real sandbox: these only drive retries, deadlines and the
breaker, whose rules do not depend on a process boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sandboxes import LaunchSpec, Limits, SandboxOutcome, StopReason


class ManualClock:
    """Time moves only when the code under test sleeps or a fake attempt takes time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def ok(stdout: bytes = b"{}") -> SandboxOutcome:
    return SandboxOutcome(exit_code=0, signal=None, stdout=stdout, stderr_tail="", duration_ms=1)


def failed(code: int = 1) -> SandboxOutcome:
    return SandboxOutcome(
        exit_code=code,
        signal=None,
        stdout=b"",
        stderr_tail="fail",
        duration_ms=1,
        reason=StopReason.EXIT_CODE,
    )


def timed_out() -> SandboxOutcome:
    return SandboxOutcome(
        exit_code=None,
        signal=9,
        stdout=b"",
        stderr_tail="",
        duration_ms=1,
        reason=StopReason.TIMEOUT,
    )


Script = Callable[[int, Limits], SandboxOutcome]


@dataclass
class FakeSandbox:
    """Answers attempt N with ``script(N, limits)``; a timeout costs its full limit."""

    script: Script
    clock: ManualClock
    name: str = "fake"
    runs: list[Limits] = field(default_factory=list)
    closed: int = 0

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> FakePrepared:
        return FakePrepared(self, limits)


@dataclass
class FakePrepared:
    owner: FakeSandbox
    limits: Limits

    async def run(self, payload: bytes) -> SandboxOutcome:
        owner = self.owner
        owner.runs.append(self.limits)
        outcome = owner.script(len(owner.runs), self.limits)
        if outcome.reason is StopReason.TIMEOUT:
            owner.clock.now += self.limits.timeout_ms / 1000
        else:
            owner.clock.now += 0.001
        return outcome

    async def close(self) -> None:
        self.owner.closed += 1
