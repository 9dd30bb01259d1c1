"""Telling "the command could not be started" from "the tool ran and failed".

The last instructions before a tool runs are a constant shell line (the subprocess
backend's shim, the docker backend's gate) ending in ``exec "$@"``. When that exec fails
(no such program, no execute right, a binary the kernel cannot run: dash says "Exec
format error" for those) the shell exits 127 or 126 itself, as any tool may; the exit
status alone proves nothing. So the shell first reads a fresh random token from the first
line of its stdin and arms an EXIT trap that prints it on stderr. The trap can only run
if the exec failed: a successful exec replaces the shell, its trap and its token, and the
tool never sees the token (read off its stdin byte by byte, never exported), so no tool
can print it, whatever it writes and however it exits.

A missing *script* given to an interpreter (``python3 missing.py``) is not caught here:
the interpreter was started and reports the failure itself, as its own exit status.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

MARKER = "runner-exec-failed"
# The shell words that arm the trap: read the token, print it should the exec fail.
# Constant text; the token arrives on stdin, never through the command line. Unset first:
# a variable of that name from the environment would stay exported, token and all.
EXEC_GUARD = (
    "unset runner_exec_token; read -r runner_exec_token && "
    f'trap \'printf "\\n{MARKER} %s\\n" "$runner_exec_token" >&2\' EXIT'
)
# What the shell exits with when its exec fails (POSIX: not found, not executable).
EXEC_FAILED_STATUSES = frozenset({126, 127})


def new_token() -> str:
    """A token for one run: unguessable, and a plain word for ``read``."""
    return secrets.token_hex(16)


def token_line(token: str) -> bytes:
    """What goes on stdin before the payload."""
    return token.encode() + b"\n"


@dataclass(frozen=True)
class ExecFailure:
    """The shell could not exec the tool's program: why (its words), and the stderr tail
    without the token."""

    why: str
    stderr_tail: str


def exec_failure(exit_code: int | None, stderr_tail: str, token: str) -> ExecFailure | None:
    """The exec failure this run's stderr proves, or None when the tool's program ran."""
    if exit_code not in EXEC_FAILED_STATUSES:
        return None
    lines = stderr_tail.splitlines()
    proof = f"{MARKER} {token}"
    if proof not in lines:
        return None
    kept = [line for line in lines[: lines.index(proof)] if line.strip()]
    # dash: "runner-exec: 1: exec: PROGRAM: not found" (or Permission denied, Exec format error)
    complaint = kept[-1] if kept else ""
    why = complaint.rsplit(": ", 1)[-1].strip() if ": " in complaint else ""
    fallback = "not found" if exit_code == 127 else "not executable"
    return ExecFailure(why=why or fallback, stderr_tail="\n".join(kept))
