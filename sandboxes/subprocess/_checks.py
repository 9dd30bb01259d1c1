"""``runner doctor`` for the subprocess backend: each layer, then a real sandbox."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from sandboxes._staging import StagingUnavailable, UserStagedWorkspace
from sandboxes.base import Check, LaunchSpec, Limits, SandboxUnavailable
from sandboxes.subprocess._launch import user_overlay_argv
from sandboxes.subprocess._network import network_checks
from sandboxes.subprocess._seccomp import SeccompUnavailable, compiled_filter

if TYPE_CHECKING:
    from sandboxes.subprocess.sandbox import SubprocessSandbox

PROBE_TIMEOUT_S = 10


def _run(argv: list[str]) -> tuple[bool, str]:
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, type(exc).__name__
    output = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, (output[-1] if output else "")[:120]


def _user_namespaces() -> Check:
    limit = Path("/proc/sys/user/max_user_namespaces")
    value = limit.read_text().strip() if limit.exists() else "?"
    ok, detail = _run(["unshare", "--user", "--map-root-user", "true"])
    return Check(
        "user namespaces",
        ok,
        f"max_user_namespaces={value} {detail}".strip(),
        "sysctl -w user.max_user_namespaces=15000 (and kernel.unprivileged_userns_clone=1 where it exists)",
    )


def _workspace_staging(backend: SubprocessSandbox) -> Check:
    """Without root: can the launcher mount a workspace's overlay (``USER_OVERLAY_SCRIPT``)?"""
    fix = "Linux 5.11 or later (an overlay in a user namespace); grant the workspace read, not write"
    if backend.user_unshare is None:
        return Check("workspace staging", False, "unshare not found", "apt-get install util-linux")
    try:  # where calls stage (a tmpfs there may lack what the overlay needs), swept if left
        backend.own_scratch_root()
    except SandboxUnavailable as exc:
        return Check("workspace staging", False, str(exc)[:300], STATE_FOLDER_FIX)
    with tempfile.TemporaryDirectory(prefix=f"{os.getpid()}-doctor-", dir=backend.scratch_root) as folder:
        workspace, stage = Path(folder) / "workspace", UserStagedWorkspace(Path(folder) / "stage", 1)
        workspace.mkdir()
        try:
            stage.create()
        except (OSError, StagingUnavailable) as exc:
            return Check("workspace staging", False, str(exc)[:160], fix)
        opened = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            staging = user_overlay_argv(backend.user_unshare, "/bin/sh", stage.root, workspace, opened)
            ok, detail = _run([*staging, "true"])
        finally:
            os.close(opened)
            stage.remove()
    if ok:
        return Check("workspace staging", True, "write grants staged in an overlay in a user namespace")
    return Check("workspace staging", False, detail, fix)


def _seccomp(memory_counted: bool) -> Check:
    try:
        size = len(compiled_filter(memory_counted=memory_counted)) // 8
    except SeccompUnavailable as exc:
        return Check("seccomp filter", False, str(exc), "apt-get install libseccomp2")
    return Check("seccomp filter", True, f"compiled with libseccomp, {size} instructions")


def _probe(backend: SubprocessSandbox) -> Check:
    """A real call: a shell that prints one JSON document, in the real sandbox."""
    outcome: list[object] = []

    async def once() -> None:
        with tempfile.TemporaryDirectory(prefix="runner-doctor-") as folder:
            Path(folder).chmod(0o755)  # a tool folder the sandbox user may enter
            command = ("/bin/sh", "-c", "cat >/dev/null; echo '{}'")
            spec = LaunchSpec("doctor", "doctor", command, Path(folder))
            prepared = await backend.prepare(spec, Limits(timeout_ms=10_000))
            try:
                outcome.append(await prepared.run(b"{}"))
            finally:
                await prepared.close()

    def in_thread() -> None:  # the caller may be on an event loop of its own
        try:
            asyncio.run(once())
        except SandboxUnavailable as exc:
            outcome.append(exc)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    result = outcome[0] if outcome else None
    if isinstance(result, SandboxUnavailable):
        return Check("hardened sandbox", False, result.message[:160], "see the layers above")
    ok = result is not None and getattr(result, "ok", False)
    if backend.rlimits_only:
        ran = "a tool ran rootless: your uid mapped inside, namespaces, rlimits, seccomp"
    elif os.geteuid() != 0:
        ran = "a tool ran rootless: your uid mapped inside, namespaces, cgroup, seccomp"
    else:
        ran = "a tool ran: own uid, namespaces, cgroup, seccomp"
    if ok:
        detail = ran
    else:  # bubblewrap's own complaint, when it said one
        said = (getattr(result, "stderr_tail", "") or "").strip().splitlines()
        detail = f"probe failed: {said[-1] if said else result}"[:200]
    return Check("hardened sandbox", ok, detail, "see the layers above")


ROOTLESS_LIMITS = (
    "without a cgroup: rlimits (address space, CPU, file size, open files), a process cap "
    "in the sandbox's user namespace, memory and CPU summed over the tool's processes (polled); "
    "memfd and System V shared memory, queues and semaphores refused (no process's memory shows them)"
)
DELEGATE = "systemd-run --user --scope -p Delegate=yes runner ..."


def _running_as() -> Check:
    return Check(
        "rootless",
        True,
        f"not root (uid {os.getuid()}): bubblewrap runs as you, the sandbox as your uid mapped "
        "inside; no uid of its own per sandbox",
    )


def _cgroup_fix() -> str:
    """The fix that applies here for per-call cgroups."""
    if os.geteuid() == 0:
        return "mount cgroup v2, or cgroup v1 with the memory, pids and cpuacct controllers"
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return (
            "cgroup v1 here: boot with systemd.unified_cgroup_hierarchy=1 for a delegated "
            f"cgroup v2 subtree ({DELEGATE}), or run as root"
        )
    return f"run the runner in a delegated subtree: {DELEGATE} (or set RUNNER_CGROUP_ROOT)"


STATE_FOLDER_FIX = "state_dir: a folder of the runner's own, in folders only root or the runner may change"


def _state_folder(backend: SubprocessSandbox) -> Check:
    """Can calls' folders be made in the state folder (fork mode's templates, and every
    call without root or in degraded mode)?"""
    if backend.state_problem is not None:
        return Check("state folder", False, backend.state_problem[:400], STATE_FOLDER_FIX)
    try:
        root = backend.own_scratch_root()
    except SandboxUnavailable as exc:
        return Check("state folder", False, str(exc)[:400], STATE_FOLDER_FIX)
    return Check("state folder", True, f"calls' folders in {root}")


def machine_checks(backend: SubprocessSandbox) -> list[Check]:
    checks = [_user_namespaces(), _state_folder(backend)]
    bwrap = backend.bwrap
    if bwrap is None:
        checks.append(Check("bubblewrap", False, "not found", "apt-get install bubblewrap"))
    else:
        checks.append(Check("bubblewrap", True, _run([bwrap, "--version"])[1]))
    if os.geteuid() != 0:
        checks.append(_running_as())
        checks.append(_workspace_staging(backend))
    if backend.cgroups is None:
        checks.append(Check("cgroups", False, str(backend.cgroup_problem)[:200], _cgroup_fix()))
        if backend.rlimits_only:
            checks.append(Check("rootless limits", True, ROOTLESS_LIMITS))
    else:
        version = backend.cgroups.version
        controllers = "memory, pids, cpuacct" if version == 1 else "memory, pids, cpu"
        checks.append(Check(f"cgroup v{version}", True, f"per-call cgroups with {controllers}"))
    checks.append(_seccomp(not backend.rlimits_only))
    checks += network_checks()
    for refused in backend.refusals():
        checks.append(Check("sandbox prerequisites", False, refused, "apt-get install util-linux"))
    checks.append(_probe(backend))
    return checks
