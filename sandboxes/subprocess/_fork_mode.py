"""Fork mode: a frozen template per tool (``_frozen``), each call cloned from it
(``_forked``). What it needs of the machine and the tool, and the template's sandbox: the
tool's own (``_layout``), with three differences. bubblewrap leaves user namespaces to
the template's filter (it sends their creation to the runner, the tracer, and fails it
for the tool); ``/tmp`` and ``/dev/shm`` are read-only (each call mounts fresh ones over
them; nothing the import writes is there for a call); and the folder of the calls'
sockets is bound read-only at ``CALLS_MOUNT``. In it, the template first enters a
Landlock domain of its own (``runner_landlock.py``, before any code of the tool's), which
keeps it and every call from reaching bubblewrap's init.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from sandboxes._identity import IdentityLease, lease_identity
from sandboxes.base import LaunchSpec, Limits, SandboxUnavailable
from sandboxes.subprocess._cgroup import CallCgroup, CgroupUnavailable
from sandboxes.subprocess._command import SHELL, reachable_by_others
from sandboxes.subprocess._forked import ForkedCall, exit_status_known
from sandboxes.subprocess._frozen import FrozenTemplate
from sandboxes.subprocess._frozen_calls import CallSetUp
from sandboxes.subprocess._launch import drop_privileges_argv, launcher_argv
from sandboxes.subprocess._layout import SANDBOX_UID, Sources, bwrap_argv, nul_separated
from sandboxes.subprocess._seccomp import compiled_filter, sealed_memfd
from sandboxes.view import LIBRARY_MOUNT, SCRATCH_MOUNT, TOOL_MOUNT, tool_env

if TYPE_CHECKING:
    from sandboxes.subprocess.sandbox import SubprocessSandbox

CALLS_MOUNT = "/run/runner-calls"
TEMPLATE_SCRIPT = f"{LIBRARY_MOUNT}/runner_fork.py"
LANDLOCK_SCRIPT = f"{LIBRARY_MOUNT}/runner_landlock.py"  # the template's first step
# What runs that step: the system's, by its full path (bound read-only from the host's
# /usr), never a ``python3`` the tool's own PATH would find first.
LANDLOCK_PYTHON = "/usr/bin/python3"
SYS_LANDLOCK_CREATE_RULESET, LANDLOCK_CREATE_RULESET_VERSION = 444, 1  # x86-64
LANDLOCK_ABI = 6  # its scoped signals, which the template's domain uses
READY_S = 30.0  # for the tool's imports
SOCKET_PATH_MAX = 108  # sun_path, its final NUL included
_PYTHON = re.compile(r"^(?:.*/)?python3(?:\.\d+)?$")
_SCRIPT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]*\.py$")


def fork_problem(owner: SubprocessSandbox, spec: LaunchSpec, limits: Limits) -> str | None:
    """Why ``spec`` cannot run in fork mode on this machine; None when it can."""
    command = spec.command
    if (
        len(command) != 2
        or not _PYTHON.match(command[0])
        or not _SCRIPT.match(command[1])
        or ".." in command[1]
    ):
        return "fork mode runs Python tools whose command is python3 SCRIPT.py"
    if spec.workspace is not None or spec.egress is not None or spec.secrets or limits.network:
        return "fork mode runs tools without a workspace, network or secrets"
    if os.geteuid() != 0 or owner.cgroups is None:
        return "fork mode needs root and cgroups (each call's limits are its cgroup's)"
    if platform.machine() != "x86_64":
        return f"fork mode needs an x86-64 machine, not {platform.machine()}"
    if owner.bwrap is None or owner.setpriv is None or owner.missing_layers() or owner.refusals():
        return "fork mode needs the hardened sandbox"
    if not exit_status_known():
        return "fork mode needs Linux 6.15 or later (a call's exit status through its pidfd)"
    if not os.access(LANDLOCK_PYTHON, os.X_OK):
        return f"fork mode needs {LANDLOCK_PYTHON}"
    if _landlock_abi() < LANDLOCK_ABI:
        return "fork mode needs Landlock's ABI 6 (Linux 6.12 or later, landlock among its security modules)"
    return None


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 or less without Landlock."""
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION))


class ToolTemplate:
    """One tool's template in fork mode; each ``call`` is a sandbox for one call, cloned
    from it when it runs. Blocking: made and discarded off the event loop.

    The template's own processes (bubblewrap, its init, the imports) are in a cgroup of
    their own with the tool's memory and process limits, and the imports under its
    CPU-time rlimit, as a sandbox's tool is.

    Raises:
        SandboxUnavailable: the machine or the tool cannot have one (``fork_problem``), or
            the template was refused (``TemplateRefused``).
    """

    def __init__(
        self, owner: SubprocessSandbox, spec: LaunchSpec, limits: Limits, stop: threading.Event
    ) -> None:
        owner.set_up()
        problem = fork_problem(owner, spec, limits)
        if problem is not None:
            raise SandboxUnavailable(problem)
        assert owner.cgroups is not None
        self._teardowns = owner.teardowns
        self._template: FrozenTemplate | None = None
        self._lock = threading.Lock()
        self._running = 0  # calls made by ``call`` and not yet discarded
        self._retired = False  # discarded once its last running call is
        # Named as a call's scratch folder: the watchdog removes it should the runner die.
        self._folder = owner.scratch_root / owner.next_name()
        self._calls = self._folder / "calls"
        if len(str(self._calls)) + len("/0123456789abcdef.err") >= SOCKET_PATH_MAX:
            raise SandboxUnavailable("fork mode: the runner's state folder's path is too long for a socket's")
        self._lease: IdentityLease | None = lease_identity()  # the template's and its calls'
        self._group: CallCgroup | None = None
        try:
            owner.own_scratch_root()
            # Only the template's gid passes: the tool's copy in it is no one else's to read.
            self._folder.mkdir(mode=0o750)
            os.chown(self._folder, 0, self._lease.gid)
            self._folder.chmod(0o750)
            self._calls.mkdir(mode=0o711)  # its sockets' names cannot be listed
            self._calls.chmod(0o711)
            tool_dir = (
                spec.tool_dir
                if reachable_by_others(spec.tool_dir)
                else _copy_tool(spec.tool_dir, self._folder)
            )
            self._group = owner.cgroups.create(limits.memory_mb, limits.max_pids)
            argv, fds = self._argv(owner, spec, limits, tool_dir)
            env = {
                "PATH": "/usr/bin:/bin",
                "RUNNER_CGROUPS": " ".join(str(path) for path in self._group.join_files),
                "RUNNER_CPU": str(limits.cpu_seconds),
                "RUNNER_PID": str(os.getpid()),  # a runner gone before the join: nothing starts
            }
            setup = CallSetUp(
                owner.cgroups, limits.memory_mb, limits.max_pids, limits.cpu_seconds, limits.disk_mb,
                (self._calls, CALLS_MOUNT),
            )  # fmt: skip
            inside = (SANDBOX_UID, TOOL_MOUNT)
            self._template = FrozenTemplate(argv, fds, env, inside, (READY_S, stop), setup)
            self._template.spare()
        except BaseException as exc:
            self.discard()
            if isinstance(exc, CgroupUnavailable):
                raise SandboxUnavailable(str(exc)) from exc
            raise

    def _argv(
        self, owner: SubprocessSandbox, spec: LaunchSpec, limits: Limits, tool_dir: Path
    ) -> tuple[list[str], tuple[int, ...]]:
        assert owner.bwrap is not None and owner.setpriv is not None
        sources = Sources(tool_dir, None, owner.etc.path, owner.library_dir, owner.etc.copies)
        # The template's first step starts with no variable of the tool's (the C library
        # would act on some: a GCONV_PATH loads a module of the tool's folder); it reads
        # the tool's environment from a descriptor, and starts the template with it.
        variables = tool_env(spec, SCRATCH_MOUNT)  # no PWD, as a sandbox's shim unsets it
        env = nul_separated([f"{key}={value}" for key, value in variables.items()], "the tool's variables")
        made = [sealed_memfd("runner-seccomp", compiled_filter(memory_counted=True, traced=True))]
        try:
            inner = bwrap_argv(spec, limits, sources, {}, seccomp_fd=made[0])
            inner = [arg for arg in inner if arg not in ("--disable-userns", "--assert-userns-disabled")]
            last = len(inner) - 1 - inner[::-1].index("--remount-ro")  # of "/": mount points first
            extra = ["--ro-bind", str(self._calls), CALLS_MOUNT]
            inner[last:last] = [*extra, "--remount-ro", SCRATCH_MOUNT, "--remount-ro", "/dev/shm"]  # noqa: S108
            made.append(sealed_memfd("runner-bwrap-args", nul_separated(inner, "the sandbox's arguments")))
            made.append(sealed_memfd("runner-tool-env", env))
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        seccomp, args, tool_environment = made
        python, script = spec.command
        lease = self._lease
        assert lease is not None
        argv = [
            *drop_privileges_argv(owner.setpriv, lease.uid, lease.gid),
            owner.bwrap, "--args", str(args), "--",
            LANDLOCK_PYTHON, "-I", "-S", LANDLOCK_SCRIPT, str(tool_environment),
            python, TEMPLATE_SCRIPT, script,
        ]  # fmt: skip
        # The sandboxes' own launcher: it joins the template's cgroup (writing 0: itself,
        # before anything else starts), bounds the imports' CPU time, then starts it.
        return launcher_argv(SHELL, argv, None), (seccomp, args, tool_environment)

    def call(self, limits: Limits) -> ForkedCall:
        """A sandbox for one call under ``limits`` (this template's, but the timeout)."""
        with self._lock:
            if self._template is None or self._retired:
                raise SandboxUnavailable("the tool's template is closed")
            self._running += 1
        return ForkedCall(self._template, limits, self._ended_call, self._teardowns)

    def ended(self) -> str | None:
        """None while calls can be forked; else why not."""
        template = self._template
        return template.ended() if template is not None else "the tool's template is closed"

    def retire(self) -> None:
        """No more calls: discard it once the calls running from it have ended (a reload:
        calls in flight finish with what they started with)."""
        with self._lock:
            self._retired = True
            now = self._running == 0
        if now:
            self.discard()

    def _ended_call(self) -> None:
        with self._lock:
            self._running -= 1
            now = self._retired and self._running == 0
            template = None if self._retired else self._template
        if now:
            self.discard()
        elif template is not None:
            template.spare()  # the next call's, made now that this one's is over

    def discard(self) -> None:
        """Kill the template and every call still running from it; give its uid back."""
        with self._lock:
            template, self._template = self._template, None
            group, self._group = self._group, None
            lease, self._lease = self._lease, None
        try:
            if template is not None:
                template.close()
        finally:
            if group is not None:
                group.remove()  # kills what is left in it first
            shutil.rmtree(self._folder, ignore_errors=True)
            if lease is not None:
                lease.release()  # the template is gone, and each call went with its cgroup


def _copy_tool(source: Path, folder: Path) -> Path:
    """The tool's folder, copied where the template's uid can reach it (and no one but
    it and root): regular files and folders only, with their permissions (links and
    special files are left out: never followed as root)."""
    target = folder / "tool"

    def skipped(directory: str, names: list[str]) -> set[str]:
        kept = set()
        for name in names:
            mode = (Path(directory) / name).lstat().st_mode
            if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                kept.add(name)
        return set(names) - kept

    shutil.copytree(source, target, symlinks=True, ignore=skipped)
    for path in (target, *target.rglob("*")):
        # As readable as the original for the template's uid, which reads as "others";
        # never set-id (the copy is root's).
        path.chmod(stat.S_IMODE(path.lstat().st_mode) & 0o777)
    return target
