"""What the runner checks of a frozen template and its calls from outside, in ``/proc``:
its processes, its namespaces, its descriptors, its shared mappings, a process's
capabilities (``_frozen``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from sandboxes._kernel import ready
from sandboxes._watchdog import parent_and_start
from sandboxes.base import SandboxUnavailable
from sandboxes.subprocess._ptrace import SEIZE, request

NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")


class TemplateRefused(SandboxUnavailable):
    """The template ended, or failed a check, before it could serve a call."""


def status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    return ""


def capabilities(pid: int) -> int:
    return int(status(pid, "CapEff") or "0", 16) | int(status(pid, "CapPrm") or "0", 16)


def shared_mappings(pid: int) -> list[tuple[int, int]]:
    found = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms[3] == "s":
            low, high = (int(part, 16) for part in span.split("-"))
            found.append((low, high))
    return found


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _descendants(roots: list[int]) -> list[int]:
    """``roots`` and every process under them (one that vanishes meanwhile: without its own)."""
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        with contextlib.suppress(FileNotFoundError):
            todo += _children(pid)
    return found


def sandboxed(bwrap: int) -> tuple[int, int, list[int]]:
    """Bubblewrap's init in the sandbox, the template (its first child) and every other
    process there."""
    inits = _children(bwrap)
    if len(inits) != 1:
        raise TemplateRefused("the tool's sandbox is not as started")
    children = _children(inits[0])
    if not children:
        raise TemplateRefused("the tool's template exited")
    template = min(children, key=lambda pid: parent_and_start(pid)[1])
    others = [pid for pid in _descendants(children) if pid != template]
    return inits[0], template, others


def untrustworthy(init: int, template: int, now: tuple[int, int, list[int]]) -> str | None:
    """What the import left that would outlive it in the template, if anything."""
    if now[:2] != (init, template):
        return "its sandbox changed while it was frozen"
    others = now[2]
    if others:
        return f"the imports left processes besides the template: {others}"
    for kind in NAMESPACES:
        if Path(f"/proc/{template}/ns/{kind}").stat().st_ino != Path(f"/proc/{init}/ns/{kind}").stat().st_ino:
            return f"the template left its sandbox's {kind} namespace"
    if any(Path(f"/proc/{template}/fd").iterdir()):
        return "descriptors are left open in the template"
    if shared_mappings(template):
        return "a shared mapping is left in the template"
    return None


def seize_alive(init: int, template: int) -> int:
    """Seize ``template`` (with no event to trace yet: until it is frozen, the tool's own
    mount or clone into new namespaces meets a tracer that does not take them, ENOSYS);
    its pidfd.

    Pinned, seen to be the template, seized, then seen alive (a traced process's pid is
    not freed before its tracer has seen it exit): a pid the template left to another
    process is never traced past the seize. Without ``EXITKILL`` yet, the tracing
    thread's end lets such a process go; the template dies with the sandbox's init.
    """
    pidfd = os.pidfd_open(template)
    try:
        if parent_and_start(template)[0] != init:
            raise TemplateRefused("the tool's template exited")
        request(SEIZE, template, 0, 0)
        if exited(pidfd):
            raise TemplateRefused("the tool's template exited")
    except BaseException:
        os.close(pidfd)
        raise
    return pidfd


def exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited."""
    return bool(ready([pidfd], 0))
