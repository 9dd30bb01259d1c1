"""The ``subprocess`` backend: bubblewrap namespaces plus one cgroup per attempt.

Guarantee: every process of the tool lives in the attempt's PID namespace and cgroup.
When the tool's main process exits, times out or breaks a limit, bubblewrap's namespace
init dies and the kernel kills everything left in the namespace; the runner then kills
whatever is still listed in the cgroup and removes it. If the runner itself is killed,
``--die-with-parent`` takes the namespace down with it.

Without root (``rootless``) bubblewrap runs as the runner's own user. Limits then come
from a delegated cgroup v2 subtree where the user has one, else from rlimits set by the
launcher and, for processes, inside the sandbox's user namespace (``_launch``): that is
the rootless level, not a degraded one.

Less isolation than that (no bubblewrap, no cgroups as root) is refused with
``SandboxUnavailable`` unless the policy sets ``sandbox.allow_degraded``; degraded runs
are marked as such in every outcome.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from sandboxes._config import read_config
from sandboxes._deferred import DeferredTeardown
from sandboxes._identity import lease_identity
from sandboxes._owners import make_own_folder, owner_alive, remove_folders
from sandboxes._prepare import Preparers, prepare_in_thread, start_ahead
from sandboxes._staging import STAGING_ROOT
from sandboxes._staging import remove_stale as remove_stale_staging
from sandboxes._state_folder import state_folder
from sandboxes._watchdog import ensure as ensure_watchdog
from sandboxes._watchdog import prestart as prestart_watchdog
from sandboxes._watchdog import watch
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import Check, LaunchSpec, Limits, SandboxUnavailable
from sandboxes.runtime_folder import runtime_folder
from sandboxes.session import SessionSandbox
from sandboxes.subprocess._cgroup import CgroupFactory, CgroupUnavailable
from sandboxes.subprocess._command import reachable_by_others
from sandboxes.subprocess._etc import SandboxEtc
from sandboxes.subprocess._fork_mode import ToolTemplate
from sandboxes.subprocess._layout import GROUP, PASSWD, RESOLV_CONF
from sandboxes.subprocess._library import publish_library
from sandboxes.subprocess._network import SandboxNetwork
from sandboxes.subprocess._prepared import PreparedSubprocess
from sandboxes.subprocess._staged_folders import FolderId, StagedFolders, folder_id

__all__ = ["PreparedSubprocess", "SubprocessConfig", "SubprocessSandbox", "create", "default_state_dir"]

# One sequence for every backend of the process: the names of the folders of their calls
# (``<pid>-<n>``, which the sweeps read the owner from) never meet.
_NAMES = itertools.count(1)


def default_state_dir() -> Path:
    """``/run/runner`` as root; else ``runner`` in the user's runtime folder
    (``sandboxes.runtime_folder``), else a folder of the user's own under the temp dir."""
    uid = os.geteuid()
    if uid == 0:
        return Path("/run/runner")
    runtime = runtime_folder(uid, os.environ)
    if runtime is not None:
        return runtime / "runner"
    return Path(tempfile.gettempdir()) / f"runner-{uid}"


class SubprocessConfig(BaseModel):
    """The policy's ``sandbox.backends.subprocess`` mapping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bwrap: str | None = None  # None: $RUNNER_BWRAP, else ``bwrap`` on PATH
    # Running with less isolation than the hardened sandbox must be asked for by name;
    # every such call is marked degraded in its answer and in the audit trail.
    allow_degraded: bool = False
    state_dir: Path | None = None


def _let_sandboxes_pass(state_dir: Path) -> None:
    """As root, the sandbox user passes through the state folder. Without root the
    sandbox is this user, and the folder is left as it is: it is also where `runner serve
    --socket` listens, 0700, or as the user opened it to the uids it admits."""
    if os.geteuid() == 0:
        state_dir.chmod(0o755)


def create(config: Mapping[str, Any]) -> SubprocessSandbox:
    """The entry point of ``subprocess`` in ``runner.sandboxes``.

    Raises:
        BackendConfigError: an unknown key or a wrong type in ``config``.
    """
    return SubprocessSandbox(read_config(SubprocessConfig, "subprocess", config))


class SubprocessSandbox:
    """Creates one hardened sandbox per attempt. Construction does no I/O: the machine is
    looked at (and the watchdog started) on first use, off the event loop."""

    name = "subprocess"

    def __init__(self, config: SubprocessConfig | None = None) -> None:
        self.config = config or SubprocessConfig()
        self._set_up_lock = threading.Lock()
        self._is_set_up = False
        # What is left of a sandbox once all its processes are dead (``PreparedSubprocess.close``).
        self.teardowns = DeferredTeardown("runner-teardown-subprocess")
        self.preparers = Preparers("runner-prepare-subprocess")
        # Teardowns a call waits for (its sandbox not dead yet at its close).
        self.closers = Preparers("runner-close-subprocess")
        self.staged: StagedFolders | None = None  # as root, made by the set-up

    async def aclose(self) -> None:
        """Wait until every sandbox's deferred teardown is done (``sandboxes._deferred``),
        and join the preparation and teardown threads."""
        await asyncio.to_thread(self._join_threads)

    def _join_threads(self) -> None:
        self.preparers.shutdown()
        self.closers.shutdown()
        self.teardowns.wait()
        if self.staged is not None:
            self.staged.shutdown()  # last: every sandbox started from it is gone

    def set_up(self) -> None:
        """Look at the machine, sweep what dead runners left, start the watchdog. Once;
        blocking (call it from a thread when on an event loop)."""
        with self._set_up_lock:
            if not self._is_set_up:
                self._set_up()
                self._is_set_up = True

    def _set_up(self) -> None:
        self.bwrap = self.config.bwrap or os.environ.get("RUNNER_BWRAP") or shutil.which("bwrap")
        if self.bwrap is not None and not os.access(self.bwrap, os.X_OK):
            self.bwrap = None
        # As root, drop to the sandbox user (setpriv) and stage mounts in a private
        # mount namespace (unshare); an unprivileged runner already is its own user.
        is_root = os.geteuid() == 0
        self.setpriv = shutil.which("setpriv") if is_root else None
        self.unshare = shutil.which("unshare") if is_root else None
        self.nsenter = shutil.which("nsenter")  # joins a networked tool's namespace (``_network``)
        # Without root, a workspace write grant is staged in a user namespace of its own.
        self.user_unshare = None if is_root else shutil.which("unshare")
        self.cgroups: CgroupFactory | None = None
        self.cgroup_problem: str | None = None
        try:
            self.cgroups = CgroupFactory()
            self.cgroups.remove_stale()
        except (CgroupUnavailable, OSError) as exc:
            self.cgroup_problem = str(exc)
        # Without root and without a delegated cgroup: limits by rlimits (``rootless``).
        self.rlimits_only = not is_root and self.cgroups is None
        self.state_dir, self.state_problem = state_folder(self.config.state_dir or default_state_dir())
        self.etc = SandboxEtc(
            self.state_dir / "etc", {"passwd": PASSWD, "group": GROUP, "resolv.conf": RESOLV_CONF}
        )
        self.library_dir = self.state_dir / "python"
        self.stage_dir = self.state_dir / "stage"
        if self.state_problem is None:  # else nothing is written there, and every sandbox refused
            try:
                self.etc.write()
                _let_sandboxes_pass(self.state_dir)
                self.library_dir = publish_library(self.library_dir)
                self._make_stage()
            except OSError as exc:  # a read-only or full file system, a file where a folder goes
                self.state_problem = f"cannot write in it: {exc}"
        if self.state_problem is None:
            if self.unshare is not None:
                self.staged = StagedFolders(self.stage_dir / "tools")
            self._remove_stale_scratch()
        self.watch_problem: str | None = None
        try:
            # Before any sandbox exists: whatever this process starts from now on is swept
            # by its watchdog should the process die.
            if self.cgroups is not None:
                for parent in self.cgroups.parents:
                    watch("cgroups", f"{self.cgroups.version}:{parent}")
            if self.state_problem is None:
                watch("scratch", str(self.scratch_root))
            if self.rlimits_only:
                watch("marked")
            if os.geteuid() == 0:
                watch("staging", str(STAGING_ROOT))
                remove_stale_staging(STAGING_ROOT, lambda name: not owner_alive(name))
        except OSError as exc:
            self.watch_problem = f"cannot start the runner's watchdog: {exc.strerror}"

    def start_early(self) -> None:
        """Begin starting the runner's watchdog, which every sandbox needs, without
        waiting for it (``StartsEarly``)."""
        prestart_watchdog()

    def checks(self) -> list[Check]:
        """``runner doctor``: each layer of the hardened sandbox, tried for real."""
        from sandboxes.subprocess._checks import machine_checks

        self.set_up()
        return machine_checks(self)

    # -- what this machine can give ---------------------------------------------------

    def missing_layers(self) -> list[str]:
        """What the hardened sandbox lacks here, each with what to do about it."""
        missing = []
        if self.bwrap is None:
            missing.append(
                "bubblewrap is not installed (apt-get install bubblewrap): without it the tool has"
                " no namespaces (it shares the host's network and processes, and reads what its"
                " user may) and no seccomp filter"
            )
        if os.geteuid() == 0 and (self.setpriv is None or self.unshare is None):
            missing.append("setpriv or unshare is not installed (apt-get install util-linux)")
        if self.cgroups is None and not self.rlimits_only:
            missing.append(f"cgroups unavailable: {self.cgroup_problem}")
        if self.bwrap is None and self.rlimits_only:
            # The process cap is set in the sandbox's user namespace, which it then lacks.
            missing.append("no cgroup and no user namespace: max_pids is not enforced")
        return missing

    def refusals(self) -> list[str]:
        """What not even a degraded run may do without: the kill guarantee and, as root,
        a way to stop being root."""
        refused = []
        if self.watch_problem is not None:
            refused.append(self.watch_problem)
        else:
            try:
                ensure_watchdog()  # one that died since is started again first
            except OSError as exc:
                refused.append(f"cannot start the runner's watchdog: {exc.strerror}")
        if os.geteuid() == 0 and self.setpriv is None:
            refused.append("setpriv is not installed (apt-get install util-linux)")
        return refused

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSubprocess:
        prepared = await prepare_in_thread(lambda: self._prepare(spec, limits), self.preparers)
        try:
            await prepared.attach_egress()
        except BaseException:
            await prepared.close()
            raise
        return prepared

    async def open_session(self, spec: LaunchSpec, limits: Limits) -> SessionSandbox:
        """A sandbox kept for the calls of one session (``HoldsSessions``)."""
        from sandboxes.subprocess._session import open_session

        return await open_session(self, spec, limits)

    def prestart(self, spec: LaunchSpec, limits: Limits) -> PreparedSubprocess:
        """A sandbox whose tool is already started and waits for its payload (blocking)."""
        return start_ahead(spec, lambda: self._prepare(spec, limits))

    def fork_template(self, spec: LaunchSpec, limits: Limits, stop: threading.Event) -> ToolTemplate:
        """The tool's frozen template, each call forked from it (``Forks``; blocking)."""
        return ToolTemplate(self, spec, limits, stop)

    def _prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSubprocess:
        self.set_up()
        if self.state_problem is not None:
            raise SandboxUnavailable(f"cannot use the state folder {self.state_dir}: {self.state_problem}")
        self.etc.refresh()  # the host's /etc files as they are now
        missing = self.missing_layers()
        if missing and not self.config.allow_degraded:
            raise SandboxUnavailable("hardened sandbox unavailable: " + "; ".join(missing))
        refused = self.refusals()
        if refused:
            raise SandboxUnavailable("sandbox unavailable: " + "; ".join(refused))
        lease = lease_identity()
        workspace: GrantedWorkspace | None = None
        cgroup = None
        network = None
        try:
            network = SandboxNetwork.open(limits, spec)
            # First: a cgroup refused makes the call degraded, and that decides the rest.
            if self.cgroups is not None:
                try:
                    cgroup = self.cgroups.create(limits.memory_mb, limits.max_pids)
                except CgroupUnavailable as exc:
                    if not self.config.allow_degraded:
                        raise SandboxUnavailable(str(exc)) from exc
                    missing.append(str(exc))
            name = self.next_name()
            # Checked once here: without root every call's /tmp has its folder in it, and
            # in degraded mode every call's TMPDIR.
            scratch_root = self.own_scratch_root() if os.geteuid() != 0 or missing else None
            user_stage = scratch_root / name if scratch_root is not None and not missing else None
            workspace = GrantedWorkspace.open(spec, limits.disk_mb, name, user_stage)
        except BaseException:
            try:
                if cgroup is not None:
                    cgroup.remove()
            finally:
                if workspace is not None:
                    workspace.release()
                if network is not None:
                    network.close()
                lease.release()
            raise
        return PreparedSubprocess(
            self,
            spec,
            limits,
            cgroup=cgroup,
            missing=tuple(missing),
            lease=lease,
            workspace=workspace,
            network=network,
            scratch_root=scratch_root,
            stage_id=self._stage_id(spec, hardened=not missing, workspace=workspace),
        )

    def _stage_id(
        self, spec: LaunchSpec, hardened: bool, workspace: GrantedWorkspace | None
    ) -> FolderId | None:
        """The tool folder's id when the sandbox is to start from the launch thread, its
        folder bound there once (``_staged_folders``): hardened, no workspace, a folder the
        sandbox user cannot reach. Read here, in the caller's mount namespace."""
        if self.staged is None or not self.staged.available or not hardened:
            return None
        if workspace is not None or reachable_by_others(spec.tool_dir):
            return None
        try:
            return folder_id(spec.tool_dir)
        except OSError:
            return None  # the launcher says what is wrong with it

    # -- housekeeping -------------------------------------------------------------------

    def _make_stage(self) -> None:
        # Empty mount points; each launcher binds onto them in its own mount namespace,
        # and the launch thread binds tool folders onto points under ``tools`` in its own.
        stage = self.stage_dir
        for name in ("tool", "workspace", "tools"):
            (stage / name).mkdir(parents=True, exist_ok=True)
        for folder in (stage, stage / "tools"):
            folder.chmod(0o755)  # whatever the runner's umask: the sandbox user passes here

    @property
    def scratch_root(self) -> Path:
        return self.state_dir / "scratch"

    def own_scratch_root(self) -> Path:
        """``scratch_root``, made if it is missing (``/run`` is emptied at boot) and passable
        by every uid whatever the runner's umask. Calls' folders are made, chowned and
        removed in it by path, so it and the state folder must be the runner's own, not
        links, and writable by no one else.

        Raises:
            SandboxUnavailable: they are not, or it cannot be made.
        """
        rule = "it and the state folder must be the runner's own, no links, writable by no one else"
        problem = f"cannot use the scratch folder {self.scratch_root} ({rule})"
        if self.state_problem is not None:
            raise SandboxUnavailable(f"{problem}: {self.state_problem}")
        try:
            make_own_folder(self.scratch_root, 0o711)
        except OSError as exc:
            raise SandboxUnavailable(f"{problem}: {exc.strerror or exc}") from exc
        return self.scratch_root

    def _remove_stale_scratch(self) -> None:
        remove_folders(self.scratch_root, lambda name: not owner_alive(name))

    def next_name(self) -> str:
        """A name for a call's folders no backend of this process used: one an earlier
        runner with this pid left (its sweep is ours, and we live) is passed over, never
        reused nor removed."""
        while True:
            name = f"{os.getpid()}-{next(_NAMES)}"
            if not any(os.path.lexists(root / name) for root in (self.scratch_root, STAGING_ROOT)):
                return name
