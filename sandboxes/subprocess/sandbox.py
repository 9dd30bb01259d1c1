"""The ``subprocess`` backend: bubblewrap namespaces plus one cgroup per attempt.

Guarantee: every process of the tool lives in the attempt's PID namespace and cgroup.
When the tool's main process exits, times out or breaks a limit, bubblewrap's namespace
init dies and the kernel kills everything left in the namespace; the runner then kills
whatever is still listed in the cgroup and removes it. If the runner itself is killed,
``--die-with-parent`` takes the namespace down with it.

Less isolation than that (no bubblewrap, no cgroups) is refused with
``SandboxUnavailable`` unless the policy sets ``sandbox.allow_degraded``; degraded runs
are marked as such in every outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from sandboxes._config import read_config
from sandboxes._deferred import DeferredTeardown
from sandboxes._ended import process_ended
from sandboxes._exchange import DialogueExchange, Exchange, PayloadExchange
from sandboxes._exec_status import exec_failure, new_token, token_line
from sandboxes._identity import IdentityLease, lease_identity
from sandboxes._kernel import signal_from_init_status
from sandboxes._owners import owner_alive, remove_folders
from sandboxes._prepare import Preparers, prepare_in_thread, start_ahead
from sandboxes._priming import Opened, prime_with
from sandboxes._staging import STAGING_ROOT
from sandboxes._staging import remove_stale as remove_stale_staging
from sandboxes._watchdog import watch
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import (
    Check,
    Dialogue,
    LaunchSpec,
    Limits,
    Opening,
    OpeningFailed,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
)
from sandboxes.subprocess._attach import attach
from sandboxes.subprocess._cgroup import CallCgroup, CgroupFactory, CgroupUnavailable
from sandboxes.subprocess._etc import SandboxEtc
from sandboxes.subprocess._launch import (
    carried_env,
    drop_privileges_argv,
    launcher_argv,
    started_shim_argv,
)
from sandboxes.subprocess._layout import GROUP, PASSWD, RESOLV_CONF, Sources, bwrap_argv
from sandboxes.subprocess._library import publish_library
from sandboxes.subprocess._network import SandboxNetwork
from sandboxes.subprocess._prime import FdPipe
from sandboxes.subprocess._process import EXIT_GRACE_S, Driven, Ending, ProcessResult, drive
from sandboxes.subprocess._seccomp import SeccompUnavailable, filter_fd, sealed_memfd
from sandboxes.subprocess._staged_folders import FolderId, NoNamespace, StagedFolders, folder_id
from sandboxes.view import SCRATCH_MOUNT, WORKSPACE_MOUNT, tool_env

SHELL = "/bin/sh"
# How long a sandbox started ahead may take to be set up before the pool moves on; one
# slower than that is still used, and its call reports whatever became of it.
STARTED_WAIT_S = 5.0
_HOST_PATH = re.compile(r"/[^\s:'\"]+")


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/runner")
    return Path(tempfile.gettempdir()) / f"runner-{os.geteuid()}"


class SubprocessConfig(BaseModel):
    """The policy's ``sandbox.backends.subprocess`` mapping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bwrap: str | None = None  # None: $RUNNER_BWRAP, else ``bwrap`` on PATH
    # Running with less isolation than the hardened sandbox must be asked for by name;
    # every such call is marked degraded in its answer and in the audit trail.
    allow_degraded: bool = False
    state_dir: Path | None = None


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
        self._sequence = itertools.count(1)
        # What is left of a sandbox once all its processes are dead (``PreparedSubprocess.close``).
        self.teardowns = DeferredTeardown("runner-teardown-subprocess")
        self.preparers = Preparers("runner-prepare-subprocess")
        self.staged: StagedFolders | None = None  # as root, made by the set-up

    async def aclose(self) -> None:
        """Wait until every sandbox's deferred teardown is done (``sandboxes._deferred``),
        and join the preparation threads."""
        await asyncio.to_thread(self._join_threads)

    def _join_threads(self) -> None:
        self.preparers.shutdown()
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
        self.nsenter = shutil.which("nsenter") if is_root else None
        self.state_dir = self.config.state_dir or default_state_dir()
        self.cgroups: CgroupFactory | None = None
        self.cgroup_problem: str | None = None
        try:
            self.cgroups = CgroupFactory()
            self.cgroups.remove_stale()
        except (CgroupUnavailable, OSError) as exc:
            self.cgroup_problem = str(exc)
        self.etc = self._write_etc()
        self.library_dir = publish_library(self.state_dir / "python")
        self.stage_dir = self._make_stage()
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
            watch("scratch", str(self.scratch_root))
            if os.geteuid() == 0:
                watch("staging", str(STAGING_ROOT))
                remove_stale_staging(STAGING_ROOT, lambda name: not owner_alive(name))
        except OSError as exc:
            self.watch_problem = f"cannot start the runner's watchdog: {exc.strerror}"

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
            missing.append("bubblewrap is not installed (apt-get install bubblewrap)")
        if os.geteuid() == 0 and (self.setpriv is None or self.unshare is None):
            missing.append("setpriv or unshare is not installed (apt-get install util-linux)")
        if self.cgroups is None:
            missing.append(f"cgroups unavailable: {self.cgroup_problem}")
        return missing

    def refusals(self) -> list[str]:
        """What not even a degraded run may do without: the kill guarantee and, as root,
        a way to stop being root."""
        refused = []
        if self.watch_problem is not None:
            refused.append(self.watch_problem)
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

    def prestart(self, spec: LaunchSpec, limits: Limits) -> PreparedSubprocess:
        """A sandbox whose tool is already started and waits for its payload (blocking)."""
        return start_ahead(spec, lambda: self._prepare(spec, limits))

    def _prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSubprocess:
        self.set_up()
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
            workspace = GrantedWorkspace.open(spec, limits.disk_mb, self.next_name())
            if self.cgroups is not None:
                try:
                    cgroup = self.cgroups.create(limits.memory_mb, limits.max_pids)
                except CgroupUnavailable as exc:
                    if not self.config.allow_degraded:
                        raise SandboxUnavailable(str(exc)) from exc
                    missing.append(str(exc))
        except BaseException:
            if workspace is not None:
                workspace.release()
            if network is not None:
                network.close()
            lease.release()
            raise
        prepared = PreparedSubprocess(self, spec, limits, cgroup, tuple(missing), lease, workspace)
        prepared.network = network
        prepared.stage_id = self._stage_id(spec, hardened=not missing, workspace=workspace)
        return prepared

    def _stage_id(
        self, spec: LaunchSpec, hardened: bool, workspace: GrantedWorkspace | None
    ) -> FolderId | None:
        """The tool folder's id when the sandbox is to start from the launch thread, its
        folder bound there once (``_staged_folders``): hardened, no workspace, a folder the
        sandbox user cannot reach. Read here, in the caller's mount namespace."""
        if self.staged is None or not self.staged.available or not hardened:
            return None
        if workspace is not None or _reachable_by_others(spec.tool_dir):
            return None
        try:
            return folder_id(spec.tool_dir)
        except OSError:
            return None  # the launcher says what is wrong with it

    # -- housekeeping -------------------------------------------------------------------

    def _write_etc(self) -> SandboxEtc:
        runner_files = {"passwd": PASSWD, "group": GROUP, "resolv.conf": RESOLV_CONF}
        etc = SandboxEtc(self.state_dir / "etc", runner_files)
        etc.write()
        self.state_dir.chmod(0o755)
        return etc

    def _make_stage(self) -> Path:
        # Empty mount points; each launcher binds onto them in its own mount namespace,
        # and the launch thread binds tool folders onto points under ``tools`` in its own.
        stage = self.state_dir / "stage"
        for name in ("tool", "workspace", "tools"):
            (stage / name).mkdir(parents=True, exist_ok=True)
        for folder in (stage, stage / "tools"):
            folder.chmod(0o755)  # whatever the runner's umask: the sandbox user passes here
        return stage

    @property
    def scratch_root(self) -> Path:
        return self.state_dir / "scratch"

    def _remove_stale_scratch(self) -> None:
        remove_folders(self.scratch_root, lambda name: not owner_alive(name))

    def next_name(self) -> str:
        return f"{os.getpid()}-{next(self._sequence)}"


class PreparedSubprocess:
    """One attempt's sandbox: its cgroup and identity exist; the process starts in ``run``."""

    def __init__(
        self,
        owner: SubprocessSandbox,
        spec: LaunchSpec,
        limits: Limits,
        cgroup: CallCgroup | None,
        missing: tuple[str, ...],
        lease: IdentityLease,
        workspace: GrantedWorkspace | None,
    ) -> None:
        self._owner = owner
        self._spec = spec
        self._limits = limits
        self._cgroup = cgroup
        self._has_cgroup = cgroup is not None  # ``_cgroup`` is None again after the teardown
        self._missing = missing
        self._hardened = not missing
        self.stage_id: FolderId | None = None  # set: start from the launch thread
        self._staged_point: Path | None = None  # where that thread bound the tool folder
        self._lease: IdentityLease | None = lease
        self._workspace = workspace
        self._fds: list[int] = []
        self._teardown_lock = threading.Lock()
        self._scratch: Path | None = None
        self._pgid: int | None = None
        self._started_read: int | None = None
        # The launcher (started ahead of the call by ``start_waiting``, or by the call), and
        # the token the exec guard reads first.
        self._popen: subprocess.Popen[bytes] | None = None
        self._token = ""
        self._opened: Opened | None = None  # primed: what the opening left for the call
        self._cpu_look_at = 0.0  # when ``_breached`` next reads the CPU time
        self.network: SandboxNetwork | None = None

    async def attach_egress(self) -> None:
        """Hand the listener made in the sandbox's namespace to the call's egress proxy."""
        listener = self.network.take_listener() if self.network is not None else None
        if listener is not None:
            assert self._spec.egress is not None
            await self._spec.egress.attach(listener)

    async def run(self, payload: bytes) -> SandboxOutcome:
        if self._opened is not None:
            raise SandboxUnavailable("a primed sandbox holds a dialogue, not a payload")
        return await self._exchange(PayloadExchange(payload, self._limits.max_output_bytes))

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        exchange = DialogueExchange(dialogue, self._limits.max_output_bytes, self._opened)
        outcome = await self._exchange(exchange)
        exchange.raise_failure()
        return outcome

    async def _exchange(self, exchange: Exchange) -> SandboxOutcome:
        """Start the tool (or take the one started ahead) and let ``exchange`` speak with it.

        Raises:
            SandboxUnavailable: the launcher could not be started.
        """
        started: float | None = None
        if self._popen is None:
            # Cold: the timeout counts from the launch. Started the way a warm sandbox is
            # (its exit watched through a pidfd), not by asyncio's own subprocess support,
            # whose child watcher starts a thread per process.
            started = time.monotonic()
            await self._astart()
        assert self._popen is not None
        return await self._run_started(self._popen, exchange, started)

    # -- started ahead of the call (SPEC 11) --------------------------------------------

    def start_waiting(self) -> None:
        """Start the tool now, blocked on its stdin until ``run`` writes the payload
        (blocking: the pool's thread). The exec guard's token goes in at once: it is this
        sandbox's own, and the sandbox serves one call only."""
        self._start_blocking()
        # Ready once the sandbox is built and its shim runs (it then writes the started
        # byte, read by ``_drive`` later: only waited for here). This also paces the pool:
        # its next sandbox is not begun while this one still takes the CPU to set up.
        assert self._started_read is not None
        select.select([self._started_read], [], [], STARTED_WAIT_S)

    def _start_blocking(self) -> None:
        """``_start``, from the launch thread when the tool folder is bound there."""
        staged = self._owner.staged
        if self.stage_id is not None and staged is not None:
            with contextlib.suppress(NoNamespace):
                if staged.run(self._start_staged):
                    return
        self._start()

    async def _astart(self) -> None:
        """``_start``, from the launch thread when the tool folder is bound there."""
        staged = self._owner.staged
        if self.stage_id is not None and staged is not None:
            with contextlib.suppress(NoNamespace):
                if await staged.arun(self._start_staged):
                    return
        self._start()

    def _start_staged(self) -> bool:
        """``_start`` on the launch thread, with the tool folder bound in its namespace;
        False, and nothing started, when it cannot be bound there."""
        assert self._owner.staged is not None and self.stage_id is not None
        try:
            point = self._owner.staged.point(self._spec.tool_dir, self.stage_id)
        except OSError:
            point = None  # the launcher binds it for this call, and says what fails
        if point is None:
            return False
        self._staged_point = point
        self._start()
        return True

    def _start(self) -> None:
        """Start the launcher, its stdin beginning with the exec guard's token line.

        Raises:
            SandboxUnavailable: the launcher could not be started, or this process ignores
                SIGCHLD (the kernel would then reap the launcher, and bubblewrap's own
                children, before anyone learns how they ended).
        """
        if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
            raise SandboxUnavailable(
                "this process ignores SIGCHLD, so no sandbox's exit status could be known: "
                "restore its default handler (signal.signal(signal.SIGCHLD, signal.SIG_DFL))"
            )
        self._token = new_token()
        argv, env, pass_fds = self._launch_command()
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd="/",
                start_new_session=True,
                pass_fds=pass_fds,
                bufsize=0,
            )
        except (OSError, ValueError) as exc:
            raise SandboxUnavailable(f"cannot start the sandbox launcher: {type(exc).__name__}") from exc
        finally:
            for fd in pass_fds:  # the launcher has its copies (or never will)
                os.close(fd)
        self._popen, self._pgid = popen, popen.pid
        assert popen.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # died already: its run says how
            popen.stdin.write(token_line(self._token))  # one line, far below PIPE_BUF: atomic

    def prime(self, opening: Opening, timeout_s: float) -> None:
        """Hold ``opening`` with the tool started ahead (blocking: the pool's thread).

        Raises:
            OpeningFailed: as ``Primes.prime`` says; the caller discards this sandbox.
        """
        if self._popen is None or self._opened is not None:
            raise OpeningFailed("only a sandbox started ahead, and not primed yet, can be primed")
        self._opened = prime_with(opening, FdPipe(self._popen, self._limits.max_output_bytes, timeout_s))

    def interrupt(self) -> None:
        self._kill_now()  # the prime reads the end of stdout at once

    def set_timeout(self, timeout_ms: int) -> None:
        self._limits = replace(self._limits, timeout_ms=timeout_ms)

    def discard(self) -> None:
        self._kill_now()
        self._close_fds()
        self._teardown()

    def ended(self) -> str | None:
        """``Waits.ended``: from the launcher's status, which stays unreaped for the run."""
        if self._popen is None or self._popen.returncode is not None:
            return None if self._popen is None else "it ended"
        return process_ended(self._popen.pid, self._hardened)

    def used_cpu_seconds(self) -> float | None:
        return self._cgroup.cpu_seconds() if self._cgroup is not None else None

    async def _run_started(
        self, popen: subprocess.Popen[bytes], exchange: Exchange, started: float | None
    ) -> SandboxOutcome:
        if started is None:
            # Warm: the timeout counts from here, the payload's moment or the dialogue's start.
            started = time.monotonic()
        try:
            proc = await attach(popen)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot attach the started sandbox: {exc.strerror}") from exc
        try:
            return await self._drive(proc, exchange, self._token, started)
        finally:
            proc.detach()

    def _launch_command(self) -> tuple[list[str], dict[str, str], tuple[int, ...]]:
        """The launcher's argv and environment, and the descriptors it inherits (the
        caller closes them once it is started). Opens the "started" pipe."""
        started_read, started_write = os.pipe()
        os.set_blocking(started_read, False)
        self._started_read = started_read
        self._fds += [started_read, started_write]
        try:
            if self._hardened:
                argv, env, _, pass_fds = self._hardened_command()
            else:
                argv, env, _, pass_fds = self._degraded_command()
            unshare = self._owner.unshare if "RUNNER_STAGE" in env else None
        except SeccompUnavailable as exc:
            raise SandboxUnavailable(str(exc)) from exc
        env["RUNNER_STARTED_FD"] = str(started_write)
        env["RUNNER_PID"] = str(os.getpid())
        return launcher_argv(SHELL, argv, unshare), env, pass_fds

    async def _drive(self, proc: Driven, exchange: Exchange, token: str, started: float) -> SandboxOutcome:
        try:
            result = await drive(
                proc,
                exchange,
                b"",  # the token line is in already (``_start``)
                self._limits.timeout_ms / 1000,
                self._kill_now,
                self._breached if self._cgroup else None,
                self._opened.stderr if self._opened is not None else None,
            )
        finally:
            tool_started = self._started_read is not None and _started(self._started_read)
            self._close_fds()
        duration_ms = (time.monotonic() - started) * 1000
        if result.ending is Ending.FINISHED:
            # The dialogue's end, not the tool's: its status is that of our kill.
            return SandboxOutcome(
                exit_code=None,
                signal=None,
                stdout=b"",
                stderr_tail=result.stderr_tail,
                duration_ms=duration_ms,
                degraded=not self._hardened,
                missing=self._missing,
            )
        return self._outcome(result, tool_started, token, duration_ms, not exchange.ends_by_exit)

    def _breached(self) -> Ending | None:
        """A limit of the tool as a whole that is already broken (polled while it runs).

        The CPU time is read again only once it could have run out: all the tool's
        processes together use at most one second per CPU per second.
        """
        assert self._cgroup is not None
        if self._cgroup.oom_kills() > 0 or self._cgroup.sockets_overran():
            return Ending.MEMORY_LIMIT
        now = time.monotonic()
        if now >= self._cpu_look_at:
            left = self._limits.cpu_seconds - self._cgroup.cpu_seconds()
            if left < 0:
                return Ending.CPU_BUDGET
            self._cpu_look_at = now + left / (os.cpu_count() or 1)
        return None

    @property
    def uid(self) -> int:
        assert self._lease is not None
        return self._lease.uid

    def _hardened_command(self) -> tuple[list[str], dict[str, str], str, tuple[int, ...]]:
        spec, owner = self._spec, self._owner
        workspace = self._workspace.source if self._workspace is not None else None
        launcher_env = self._launcher_env({"PATH": "/usr/bin:/bin"})
        tool_dir, workspace = self._stage(launcher_env, workspace)
        sources = Sources(tool_dir, workspace, owner.etc.path, owner.library_dir, owner.etc.copies)
        # Secrets too: bubblewrap's arguments reach it through a sealed memfd, not argv.
        env = tool_env(spec, SCRATCH_MOUNT, WORKSPACE_MOUNT if workspace else None) | dict(spec.secrets)
        command = started_shim_argv(SHELL, list(spec.command))
        assert owner.bwrap is not None
        seccomp = filter_fd()
        try:
            inner = bwrap_argv(
                spec, self._limits, sources, env, seccomp_fd=seccomp, own_network=self.network is not None
            )
            # The arguments go through a descriptor: inside, /proc/1/cmdline (bubblewrap's
            # init) would otherwise show every host path and value of them.
            args = sealed_memfd("runner-bwrap-args", b"".join(a.encode() + b"\0" for a in inner))
        except BaseException:
            os.close(seccomp)
            raise
        argv = [owner.bwrap, "--args", str(args), "--", *command]
        if owner.setpriv is not None:
            argv = drop_privileges_argv(owner.setpriv, self.uid, self._lease_gid()) + argv
        return self._entering_network(argv), launcher_env, "/", (seccomp, args)

    def _entering_network(self, argv: list[str]) -> list[str]:
        """Join the sandbox's own network namespace first (as root), when it has one."""
        if self.network is None:
            return argv
        assert self._owner.nsenter is not None  # SandboxNetwork.open checked it
        return self.network.enter_argv(self._owner.nsenter) + argv

    def _stage(self, launcher_env: dict[str, str], workspace: Path | None) -> tuple[Path, Path | None]:
        """Where the sandbox user finds the tool folder and the workspace.

        As root, the launcher binds them onto fixed staging points in a mount namespace
        of its own when the sandbox user could not reach them, and always for the
        workspace: its path was checked component by component and must be bound there,
        not resolved again by someone less careful.
        """
        spec, owner = self._spec, self._owner
        if self._staged_point is not None:  # bound once, in the launch thread's namespace
            return self._staged_point, None
        if owner.unshare is None or (workspace is None and _reachable_by_others(spec.tool_dir)):
            return spec.tool_dir, workspace
        stage = owner.stage_dir
        launcher_env["RUNNER_STAGE"] = str(stage)
        launcher_env["RUNNER_TOOL_DIR"] = str(spec.tool_dir)
        if workspace is not None:
            launcher_env["RUNNER_WORKSPACE_DIR"] = str(workspace)
        return stage / "tool", stage / "workspace" if workspace is not None else None

    def _lease_gid(self) -> int:
        assert self._lease is not None
        return self._lease.gid

    def _degraded_command(self) -> tuple[list[str], dict[str, str], str, tuple[int, ...]]:
        spec = self._spec
        self._owner.scratch_root.mkdir(mode=0o711, parents=True, exist_ok=True)
        self._scratch = self._owner.scratch_root / self._owner.next_name()
        self._scratch.mkdir(mode=0o700)
        vmem = {} if self._cgroup else {"RUNNER_VMEM_KB": str(self._limits.memory_mb * 1024)}
        launcher_env: dict[str, str] = {}
        granted = self._workspace.source if self._workspace is not None else None
        tool_dir, workspace = self._stage(launcher_env, granted)
        launcher_env["RUNNER_CHDIR"] = str(tool_dir)
        # Secrets too: the launcher's environment, readable by root and by the tool's own uid
        # only; carried under other names, as nothing run as root may act on the tool's
        # variables (a PATH into the tool's folder would make the launcher's `mount` its own).
        workspace_text = str(workspace) if workspace is not None else None
        env = tool_env(spec, str(self._scratch), workspace_text, str(self._owner.library_dir))
        try:
            carried = carried_env(env | dict(spec.secrets))
        except ValueError as exc:
            raise SandboxUnavailable(f"the tool's environment cannot be passed on: {exc}") from exc
        command = started_shim_argv(SHELL, list(spec.command))
        if self._owner.setpriv is not None:
            # Less isolation, never root: the tool still runs as a uid of its own.
            os.chown(self._scratch, self.uid, self._lease_gid(), follow_symlinks=False)
            command = drop_privileges_argv(self._owner.setpriv, self.uid, self._lease_gid()) + command
        return self._entering_network(command), self._launcher_env(carried | vmem | launcher_env), "/", ()

    def _launcher_env(self, env: dict[str, str]) -> dict[str, str]:
        env = dict(env)
        env["RUNNER_CPU"] = str(self._limits.cpu_seconds)
        if self._cgroup is not None:
            env["RUNNER_CGROUPS"] = " ".join(str(p) for p in self._cgroup.join_files)
        return env

    def _kill_now(self) -> None:
        """Kill what can be killed without waiting (on the event loop, at the end of a run).

        The launcher's process group is signalled by its number only while the launcher
        is not reaped, when that number is surely still its group's. Once reaped, the
        number may already lead another group (another call's launcher: ``pid_max`` is
        small), and a sandbox with a cgroup has its every process killed through it. Only
        a run without one still signals the group then: there, nothing else would.
        """
        if self._cgroup is not None:
            self._cgroup.kill_once()
        launcher_unreaped = self._popen is not None and self._popen.returncode is None
        if self._pgid is not None and (launcher_unreaped or not self._has_cgroup):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pgid, signal.SIGKILL)

    def _outcome(
        self, result: ProcessResult, started_ok: bool, token: str, duration_ms: float, zero_fails: bool
    ) -> SandboxOutcome:
        rc = result.returncode
        sig: int | None = None
        if rc is not None and rc < 0:
            sig, rc = -rc, None
        elif self._hardened and rc is not None and started_ok and signal_from_init_status(rc):
            sig, rc = signal_from_init_status(rc), None  # bubblewrap's init: 128 + N
        reason = self._reason(result, rc, sig, started_ok)
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
            degraded=not self._hardened,
            missing=self._missing,
        )

    def _reason(
        self, result: ProcessResult, rc: int | None, sig: int | None, started_ok: bool
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
        cgroup = self._cgroup
        if cgroup and cgroup.sockets_overran():  # between the last poll and the exit
            return StopReason.MEMORY_LIMIT
        if rc == 0:
            return None
        if cgroup and cgroup.oom_kills() > 0:
            return StopReason.MEMORY_LIMIT
        if sig == signal.SIGXCPU or (
            sig == signal.SIGKILL and cgroup and cgroup.cpu_seconds() >= self._limits.cpu_seconds
        ):
            return StopReason.CPU_LIMIT
        if cgroup and cgroup.pids_refused() > 0:
            return StopReason.PIDS_LIMIT
        if sig is not None:
            return StopReason.SIGNAL
        return StopReason.EXIT_CODE

    def _close_fds(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    async def close(self) -> None:
        self._kill_now()
        self._close_fds()
        if self._all_dead():
            # Only empty folders and bookkeeping are left: off the call's path (a cgroup
            # rmdir and a thread hop on this loop cost ~1 ms of a warm call's ~10).
            self._owner.teardowns.submit(self._teardown)
            return
        # Waiting for a fork bomb's last members to die, applying staged writes: blocking
        # work, in a thread. Once started it finishes even if this close is cancelled.
        await asyncio.to_thread(self._teardown)

    def _all_dead(self) -> bool:
        """Whether nothing of this sandbox runs any more and its teardown would only remove
        and release (no staged writes to apply, no network to close): its launcher reaped
        and its cgroup empty (one ``cgroup.procs`` read, fine on the loop). Without a
        cgroup (degraded) nothing proves it: False."""
        if self._cgroup is None or self._workspace is not None or self.network is not None:
            return False
        if self._popen is not None and self._popen.returncode is None:
            return False
        return not self._cgroup.members(everywhere=False)

    def _teardown(self) -> None:
        with self._teardown_lock:  # a second close (after a cancel) may run at the same time
            self._teardown_locked()

    def _teardown_locked(self) -> None:
        # Each step runs whatever the one before it raised: a failed apply must neither
        # keep the uid leased nor leave the cgroup behind.
        try:
            if self._cgroup is not None:
                self._cgroup.remove()  # kills until empty, then removes
                self._cgroup = None
        finally:
            self._reap_started()
            try:
                if self._scratch is not None:
                    shutil.rmtree(self._scratch, ignore_errors=True)
                    self._scratch = None
                workspace, self._workspace = self._workspace, None
                if workspace is not None:
                    workspace.release()  # staged writes applied only now: the tool is gone
            finally:
                if self._lease is not None and self._cgroup is None:
                    self._lease.release()  # only now: every process of that uid is gone
                    self._lease = None
                if self.network is not None:
                    self.network.close()  # even if a process survived: it loses its way out
                    self.network = None

    def _reap_started(self) -> None:
        """The started-ahead process: killed (its group too) and reaped, its pipes closed."""
        popen, self._popen = self._popen, None
        if popen is None:
            return
        popen.kill()  # a no-op once reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(EXIT_GRACE_S)
        for pipe in (popen.stdin, popen.stdout, popen.stderr):
            if pipe is not None:
                pipe.close()


@functools.lru_cache(maxsize=1024)
def _reachable_by_others(path: Path) -> bool:
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


def _started(started_fd: int) -> bool:
    """Did the sandbox get as far as exec'ing the tool? (The shim then wrote one byte.)"""
    try:
        return os.read(started_fd, 1) == b"s"
    except (BlockingIOError, OSError):
        return False


def _setup_message(stderr_tail: str) -> str:
    """The launcher's own complaint (the runner masks host paths in it)."""
    for line in reversed(stderr_tail.splitlines()):
        if line.startswith(("bwrap:", "runner-launch:", "setpriv:")):
            return _HOST_PATH.sub("<path>", line)[:200]
    return "the sandbox could not be set up"
