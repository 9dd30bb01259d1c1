"""The command that starts one subprocess sandbox: the launcher's argv, its environment
and the descriptors it inherits, hardened (bubblewrap) or degraded (the launcher alone)."""

from __future__ import annotations

import functools
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sandboxes._staging import INODES_PER_MB
from sandboxes._watchdog import OWNER_MARK
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import LaunchSpec, Limits, SandboxUnavailable
from sandboxes.subprocess._cgroup import CallCgroup
from sandboxes.subprocess._launch import (
    ROOTLESS_NOFILE,
    ROOTLESS_VMEM_FACTOR,
    UserTmpfs,
    carried_env,
    drop_privileges_argv,
    launcher_argv,
    started_shim_argv,
    user_namespace_argv,
)
from sandboxes.subprocess._layout import Sources, bwrap_argv, nul_separated
from sandboxes.subprocess._network import SandboxNetwork
from sandboxes.subprocess._seccomp import SeccompUnavailable, filter_fd, sealed_memfd
from sandboxes.view import SCRATCH_MOUNT, WORKSPACE_MOUNT, tool_env

if TYPE_CHECKING:
    from sandboxes.subprocess.sandbox import SubprocessSandbox

SHELL = "/bin/sh"


@dataclass(frozen=True)
class Launch:
    """What ``subprocess.Popen`` gets to start one sandbox's launcher."""

    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...]  # the starter closes them once the launcher has its copies
    started_read: int  # the "started" pipe's read end (the shim writes one byte on it)
    pipe: tuple[int, int]  # both ends of that pipe: the sandbox closes them after its run


class SandboxCommand:
    """Builds the launch of one sandbox from what its backend prepared for it. A degraded
    sandbox's scratch folder is made here (``scratch``), and removed by ``remove_scratch``."""

    def __init__(
        self,
        owner: SubprocessSandbox,
        spec: LaunchSpec,
        limits: Limits,
        *,
        hardened: bool,
        uid: int,
        gid: int,
        cgroup: CallCgroup | None,
        network: SandboxNetwork | None,
        workspace: GrantedWorkspace | None,
        scratch_root: Path | None,
    ) -> None:
        self._owner = owner
        self._spec = spec
        self._limits = limits
        self._hardened = hardened
        self.uid = uid
        self._gid = gid
        self._cgroup = cgroup
        self.network = network
        self._workspace = workspace
        self._scratch_root = scratch_root  # checked (``own_scratch_root``): where ``scratch`` goes
        self.scratch: Path | None = None
        # Descriptors the tool itself inherits, same numbers (a session agent's control
        # socket); handed over, and closed here, by the launch.
        self.inherited: tuple[int, ...] = ()

    def launch(self, staged_point: Path | None) -> Launch:
        """The launcher's argv and environment, and the descriptors it inherits. Opens the
        "started" pipe. ``staged_point``: where the launch thread bound the tool folder.

        Raises:
            SandboxUnavailable: seccomp or the tool's environment cannot be set up.
        """
        started_read, started_write = os.pipe()
        os.set_blocking(started_read, False)
        try:
            if self._hardened:
                argv, env, _, pass_fds = self._hardened_command(staged_point)
            else:
                argv, env, _, pass_fds = self._degraded_command(staged_point)
            unshare = self._owner.unshare if "RUNNER_STAGE" in env else None
        except BaseException as exc:
            for fd in (started_read, started_write):
                os.close(fd)
            if isinstance(exc, SeccompUnavailable):
                raise SandboxUnavailable(str(exc)) from exc
            raise
        env["RUNNER_STARTED_FD"] = str(started_write)
        env["RUNNER_PID"] = str(os.getpid())
        argv = launcher_argv(SHELL, argv, unshare)
        pass_fds, self.inherited = pass_fds + self.inherited, ()
        return Launch(argv, env, pass_fds, started_read, (started_read, started_write))

    def remove_scratch(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def _hardened_command(
        self, staged_point: Path | None
    ) -> tuple[list[str], dict[str, str], str, tuple[int, ...]]:
        spec, owner = self._spec, self._owner
        workspace = self._workspace.source if self._workspace is not None else None
        launcher_env = self._launcher_env({"PATH": "/usr/bin:/bin"})
        tool_dir, workspace = self._stage(launcher_env, workspace, staged_point)
        if self._workspace is not None and self._workspace.user_stage is not None:
            workspace = self._workspace.user_stage.merged
        tmpfs = self._user_tmpfs()
        sources = Sources(
            tool_dir, workspace, owner.etc.path, owner.library_dir, owner.etc.copies,
            tmpfs.folder if tmpfs is not None else None,
        )  # fmt: skip
        # Secrets too: bubblewrap's arguments reach it through a sealed memfd, not argv.
        env = tool_env(spec, SCRATCH_MOUNT, WORKSPACE_MOUNT if workspace else None) | dict(spec.secrets)
        cap = self._limits.max_pids if owner.rlimits_only else None
        if cap is not None:
            try:
                env = carried_env(env)  # unpacked by the rootless shim (``ROOTLESS_SHIM``)
            except ValueError as exc:
                raise SandboxUnavailable(f"the tool's environment cannot be passed on: {exc}") from exc
        command = started_shim_argv(SHELL, list(spec.command), cap)
        if owner.bwrap is None:
            raise SandboxUnavailable("bubblewrap is not installed")  # missing_layers says so first
        seccomp = filter_fd(memory_counted=not owner.rlimits_only)
        try:
            inner = bwrap_argv(
                spec, self._limits, sources, env, seccomp_fd=seccomp, own_network=self.network is not None
            )
            # The arguments go through a descriptor: inside, /proc/1/cmdline (bubblewrap's
            # init) would otherwise show every host path and value of them.
            args = sealed_memfd("runner-bwrap-args", nul_separated(inner, "the sandbox's arguments"))
        except BaseException:
            os.close(seccomp)
            raise
        argv = [owner.bwrap, "--args", str(args), "--", *command]
        if owner.setpriv is not None:
            argv = drop_privileges_argv(owner.setpriv, self.uid, self._gid) + argv
        if tmpfs is not None:
            argv = self._user_mounts(tmpfs) + argv
        return self._entering_network(argv), launcher_env, "/", (seccomp, args)

    def _user_tmpfs(self) -> UserTmpfs | None:
        """Without root, the call's folder for the bounded /tmp and /dev/shm (``scratch``,
        removed with it), their mount points made in it."""
        if os.geteuid() == 0:
            return None
        if self._owner.user_unshare is None:
            problem = "unshare is not installed (apt-get install util-linux)"
            raise SandboxUnavailable(f"{problem}: without root, the sandbox's /tmp and /dev/shm need it")
        assert self._scratch_root is not None  # the backend checked it for a call without root
        try:
            self.scratch = self._scratch_root / self._owner.next_name()
            self.scratch.mkdir(mode=0o700)
            for point in ("tmp", "shm"):
                (self.scratch / point).mkdir(mode=0o700)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot make the folder of the sandbox's /tmp: {exc}") from exc
        disk_mb = self._limits.disk_mb
        return UserTmpfs(self.scratch, disk_mb * 1024 * 1024, max(1024, disk_mb * INODES_PER_MB))

    def _user_mounts(self, tmpfs: UserTmpfs) -> list[str]:
        """Without root: bubblewrap started in a user namespace whose mount namespace has
        the bounded tmpfs and, with a workspace write grant, the workspace's overlay
        (``_launch.user_namespace_argv``)."""
        assert self._owner.user_unshare is not None  # _user_tmpfs checked it
        overlay = None
        workspace = self._workspace
        if workspace is not None and workspace.user_stage is not None:
            overlay = (workspace.user_stage.root, workspace.source, workspace.fd)
        return user_namespace_argv(self._owner.user_unshare, SHELL, tmpfs, overlay)

    def _entering_network(self, argv: list[str]) -> list[str]:
        """Join the sandbox's own network namespace first (as root), when it has one."""
        if self.network is None:
            return argv
        assert self._owner.nsenter is not None  # SandboxNetwork.open checked it
        return self.network.enter_argv(self._owner.nsenter) + argv

    def _stage(
        self, launcher_env: dict[str, str], workspace: Path | None, staged_point: Path | None
    ) -> tuple[Path, Path | None]:
        """Where the sandbox user finds the tool folder and the workspace.

        As root, the launcher binds them onto fixed staging points in a mount namespace
        of its own when the sandbox user could not reach them, and always for the
        workspace: its path was checked component by component and must be bound there,
        not resolved again by someone less careful.
        """
        spec, owner = self._spec, self._owner
        if staged_point is not None:  # bound once, in the launch thread's namespace
            return staged_point, None
        if owner.unshare is None or (workspace is None and reachable_by_others(spec.tool_dir)):
            return spec.tool_dir, workspace
        stage = owner.stage_dir
        launcher_env["RUNNER_STAGE"] = str(stage)
        launcher_env["RUNNER_TOOL_DIR"] = str(spec.tool_dir)
        if workspace is not None:
            launcher_env["RUNNER_WORKSPACE_DIR"] = str(workspace)
        return stage / "tool", stage / "workspace" if workspace is not None else None

    def _degraded_command(
        self, staged_point: Path | None
    ) -> tuple[list[str], dict[str, str], str, tuple[int, ...]]:
        spec = self._spec
        assert self._scratch_root is not None  # the backend checked it for a degraded call
        self.scratch = self._scratch_root / self._owner.next_name()
        self.scratch.mkdir(mode=0o700)
        vmem = {} if self._cgroup else {"RUNNER_VMEM_KB": str(self._limits.memory_mb * 1024)}
        launcher_env: dict[str, str] = {}
        granted = self._workspace.source if self._workspace is not None else None
        tool_dir, workspace = self._stage(launcher_env, granted, staged_point)
        launcher_env["RUNNER_CHDIR"] = str(tool_dir)
        # Secrets too: the launcher's environment, readable by root and by the tool's own uid
        # only; carried under other names, as nothing run as root may act on the tool's
        # variables (a PATH into the tool's folder would make the launcher's `mount` its own).
        workspace_text = str(workspace) if workspace is not None else None
        env = tool_env(spec, str(self.scratch), workspace_text, str(self._owner.library_dir))
        try:
            carried = carried_env(env | dict(spec.secrets))
        except ValueError as exc:
            raise SandboxUnavailable(f"the tool's environment cannot be passed on: {exc}") from exc
        command = started_shim_argv(SHELL, list(spec.command))
        if self._owner.setpriv is not None:
            # Less isolation, never root: the tool still runs as a uid of its own.
            os.chown(self.scratch, self.uid, self._gid, follow_symlinks=False)
            command = drop_privileges_argv(self._owner.setpriv, self.uid, self._gid) + command
        return self._entering_network(command), self._launcher_env(carried | vmem | launcher_env), "/", ()

    def _launcher_env(self, env: dict[str, str]) -> dict[str, str]:
        env = dict(env)
        env["RUNNER_CPU"] = str(self._limits.cpu_seconds)
        if self._cgroup is not None:
            env["RUNNER_CGROUPS"] = " ".join(str(p) for p in self._cgroup.join_files)
        elif self._owner.rlimits_only:
            # Each process's own: address space (``_tree`` polls the sum), file size (the
            # scratch bound, in dash's 512-byte blocks), open files; the process cap is set
            # inside (``ROOTLESS_SHIM``).
            env["RUNNER_VMEM_KB"] = str(self._limits.memory_mb * 1024 * ROOTLESS_VMEM_FACTOR)
            env["RUNNER_FSIZE_BLOCKS"] = str(self._limits.disk_mb * 2048)
            env["RUNNER_NOFILE"] = str(ROOTLESS_NOFILE)
            # Kept by bubblewrap's processes, for the watchdog's sweep (``OWNER_MARK``).
            env[OWNER_MARK] = str(os.getpid())
        return env


@functools.lru_cache(maxsize=1024)
def reachable_by_others(path: Path) -> bool:
    """Can any user reach ``path`` (search right on every ancestor, read on the folder)?

    Then the sandbox user can mount it directly and the staging mount namespace, which
    costs two more execs per call, is not needed. A wrong answer fails closed: bubblewrap
    cannot mount what it cannot reach, and the call ends ``sandbox_unavailable``.
    """
    try:
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in [path, *path.parents])
    except OSError:
        return False
