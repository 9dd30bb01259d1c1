"""A backend that keeps only part of the contract, and mutants of it that break the rest.

``test_contract_kit.py`` runs each check of ``sandboxes.testing`` against a backend that
breaks exactly what that check is about, to show that every check can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from sandboxes import LaunchSpec, Limits, SandboxOutcome, StopReason


def _host_safety() -> None:
    """Not a sandbox, but the test machine must survive the checks that hog it."""
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (3, 3))
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))


def _blocking_run(spec: LaunchSpec, payload: bytes, timeout_s: float) -> tuple[int, bytes, bytes, bool]:
    """Run the tool with its output in files (bounded by RLIMIT_FSIZE); kill only the main
    process at the timeout. Runs in a thread: a cancelled caller does not stop it."""
    env = {"PATH": "/usr/bin:/bin", **spec.env}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            list(spec.command),
            cwd=spec.tool_dir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            preexec_fn=_host_safety,  # noqa: PLW1509 - a test double, not the runner
        )
        timed_out = False
        try:
            proc.communicate(payload, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # the main process only: its children live on
            proc.wait()
            timed_out = True
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), timed_out


class NaiveSandbox:
    """A plain subprocess: no limits but the timeout, which kills the main process only."""

    name = "naive"

    def __init__(self, flaw: str = "") -> None:
        self.flaw = flaw

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> NaivePrepared:
        return NaivePrepared(self.flaw, spec, limits)


class NaivePrepared:
    def __init__(self, flaw: str, spec: LaunchSpec, limits: Limits) -> None:
        self._flaw = flaw
        self._spec = spec
        self._limits = limits
        self._closed = False
        if flaw == "leaky_prepare":  # starts something at prepare time that close forgets
            env = {"PATH": "/usr/bin:/bin", **spec.env}
            LEAKED.append(subprocess.Popen(["sleep", "30"], env=env))
            _until_visible(spec.request_id)

    async def run(self, payload: bytes) -> SandboxOutcome:
        started = time.monotonic()
        rc, stdout, stderr, timed_out = await asyncio.to_thread(
            _blocking_run, self._spec, payload, self._limits.timeout_ms / 1000
        )
        reason = StopReason.TIMEOUT if timed_out else None if rc == 0 else StopReason.EXIT_CODE
        outcome = SandboxOutcome(
            exit_code=rc,
            signal=None,
            stdout=stdout,
            stderr_tail=stderr[-8192:].decode(errors="replace"),
            duration_ms=(time.monotonic() - started) * 1000,
            reason=reason,
        )
        if self._flaw == "wrong_stdout":
            outcome = replace(outcome, stdout=outcome.stdout + b"garbage")
        if self._flaw == "exit_zero":
            outcome = replace(outcome, exit_code=0, reason=None)
        if self._flaw == "no_stderr":
            outcome = replace(outcome, stderr_tail="")
        return outcome

    async def close(self) -> None:
        if self._closed and self._flaw == "close_twice_raises":
            raise RuntimeError("closed twice")
        self._closed = True


LEAKED: list[subprocess.Popen[bytes]] = []  # what the leaky mutant left, for the test to reap


def _until_visible(request_id: str) -> None:
    """Until the leaked process shows its environment: fresh from ``Popen`` it may be in
    the middle of its exec, its environment still empty."""
    from sandboxes.testing import processes_alive

    deadline = time.monotonic() + 5
    while not processes_alive(request_id) and time.monotonic() < deadline:
        time.sleep(0.01)


def kill_leftovers(request_id: str) -> None:
    """What the test cleans up after a mutant (a check may fail with a process still alive)."""
    from sandboxes.testing import processes_alive

    needle = f"REQUEST_ID={request_id}".encode()
    if not processes_alive(request_id):
        return
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                if needle in environ.split(b"\0"):
                    os.kill(int(entry), 9)
