"""How a subprocess sandbox's run ended, told from its launcher's status, the started
byte, the cgroup's counters and the exec guard's token (``sandboxes._exec_status``)."""

from __future__ import annotations

import os
import re
import signal

from sandboxes._exec_status import exec_failure
from sandboxes._kernel import signal_from_init_status
from sandboxes.base import Limits, SandboxOutcome, StopReason
from sandboxes.subprocess._cgroup import CallCgroup
from sandboxes.subprocess._process import Ending, ProcessResult

# How programs report an allocation the address-space rlimit refused (without a cgroup
# there is no OOM counter to read): Python, glibc's perror, C++, Node, Go.
# Whole lines in the shapes those runtimes write, not the words anywhere: an honest tool
# that echoes what it was given on stderr is not stopped for it.
_OUT_OF_MEMORY = re.compile(
    r"^(?:MemoryError(?::.*)?"
    r"|[^\n]*: Cannot allocate memory"
    r"|terminate called after throwing an instance of 'std::bad_alloc'"
    r"|FATAL ERROR: [^\n]*JavaScript heap out of memory"
    r"|fatal error: runtime: out of memory)$",
    re.MULTILINE,
)


def out_of_memory(stderr_text: str) -> bool:
    """Whether some process of the tool said an allocation was refused. A tool can only
    misname its own failure this way, never escape a limit."""
    return _OUT_OF_MEMORY.search(stderr_text) is not None


_HOST_PATH = re.compile(r"/[^\s:'\"]+")


def outcome(
    result: ProcessResult,
    started_ok: bool,
    token: str,
    duration_ms: float,
    zero_fails: bool,
    *,
    missing: tuple[str, ...],
    cgroup: CallCgroup | None,
    limits: Limits,
    pids_capped: bool = False,
) -> SandboxOutcome:
    """The outcome of a run whose tool ended (exited, was killed, or never started);
    ``missing``: the layers a degraded sandbox lacked (empty: hardened); ``pids_capped``:
    the rootless shim saw the tool fill its process cap."""
    hardened = not missing
    rc = result.returncode
    sig: int | None = None
    if rc is not None and rc < 0:
        sig, rc = -rc, None
    elif hardened and rc is not None and started_ok and signal_from_init_status(rc):
        sig, rc = signal_from_init_status(rc), None  # bubblewrap's init: 128 + N
    reason = _reason(result, rc, sig, started_ok, cgroup, limits)
    if reason in (StopReason.EXIT_CODE, StopReason.SIGNAL) and cgroup is None:
        reason = _rlimit_reason(result.stderr_tail, pids_capped) or reason
    if reason is None and zero_fails:
        reason = StopReason.EXIT_CODE
    message = ""
    if reason is StopReason.SANDBOX_UNAVAILABLE:
        message = _setup_message(result.stderr_tail)
    stderr_tail = result.stderr_tail
    failure = exec_failure(rc, stderr_tail, token) if reason is StopReason.EXIT_CODE else None
    if failure is not None:
        reason, message, stderr_tail = StopReason.NOT_EXECUTABLE, failure.why, failure.stderr_tail
    if not started_ok:
        # Nothing of the tool ran: the text is the launcher's, with host paths in it.
        stderr_tail = message or _setup_message(stderr_tail)
    return SandboxOutcome(
        exit_code=rc,
        signal=sig,
        stdout=result.stdout,
        stderr_tail=stderr_tail,
        duration_ms=duration_ms,
        reason=reason,
        message=message,
        degraded=not hardened,
        missing=missing,
    )


def _reason(
    result: ProcessResult,
    rc: int | None,
    sig: int | None,
    started_ok: bool,
    cgroup: CallCgroup | None,
    limits: Limits,
) -> StopReason | None:
    ending = result.ending
    if ending is Ending.TIMEOUT:
        return StopReason.TIMEOUT
    if ending is Ending.OUTPUT_LIMIT:
        return StopReason.OUTPUT_LIMIT
    if ending is Ending.CPU_BUDGET:
        return StopReason.CPU_LIMIT
    if ending is Ending.MEMORY_LIMIT:
        return StopReason.MEMORY_LIMIT
    if not started_ok:  # the shim never ran: the launcher or bubblewrap gave up
        return StopReason.SANDBOX_UNAVAILABLE
    if cgroup and cgroup.sockets_overran():  # between the last poll and the exit
        return StopReason.MEMORY_LIMIT
    if rc == 0:
        return None
    if cgroup and cgroup.oom_kills() > 0:
        return StopReason.MEMORY_LIMIT
    if sig == signal.SIGXCPU or (
        sig == signal.SIGKILL and cgroup and cgroup.cpu_seconds() >= limits.cpu_seconds
    ):
        return StopReason.CPU_LIMIT
    if cgroup and cgroup.pids_refused() > 0:
        return StopReason.PIDS_LIMIT
    if sig is not None:
        return StopReason.SIGNAL
    return StopReason.EXIT_CODE


def _rlimit_reason(stderr_tail: str, pids_capped: bool) -> StopReason | None:
    """A failure without a cgroup to tell why: the process cap filled (the shim saw it),
    or an allocation refused by the address-space limit (the tool said so)."""
    if pids_capped:
        return StopReason.PIDS_LIMIT
    if out_of_memory(stderr_tail):
        return StopReason.MEMORY_LIMIT
    return None


def shim_marks(started_fd: int) -> bytes:
    """What the shim wrote on the started pipe: ``s`` once the tool is about to start, and
    from the rootless shim ``p`` after it when the tool's processes filled their cap."""
    try:
        return os.read(started_fd, 2)
    except (BlockingIOError, OSError):
        return b""


def _setup_message(stderr_tail: str) -> str:
    """The launcher's own complaint (the runner masks host paths in it)."""
    for line in reversed(stderr_tail.splitlines()):
        if line.startswith(("bwrap:", "runner-launch:", "setpriv:")):
            return _HOST_PATH.sub("<path>", line)[:200]
    return "the sandbox could not be set up"
