"""One attempt's subprocess sandbox, from its preparation to its teardown.

Its cgroup, uid, workspace and network exist from its constructor on; its launcher starts
ahead of the call (``start_waiting``, a warm pool) or for it (a cold run). The stages it
goes through are ``sandboxes._prepared.Stage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING

from sandboxes._ended import process_ended
from sandboxes._exchange import Exchange
from sandboxes._exec_status import new_token, token_line
from sandboxes._identity import IdentityLease
from sandboxes._kernel import ready
from sandboxes._prepare import submit
from sandboxes._prepared import OneRun, Stage
from sandboxes._priming import PrimingPipe
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import LaunchSpec, Limits, SandboxOutcome, SandboxUnavailable
from sandboxes.events import StderrSplitter
from sandboxes.subprocess._attach import attach
from sandboxes.subprocess._cgroup import CallCgroup
from sandboxes.subprocess._command import SandboxCommand
from sandboxes.subprocess._launch import PIDS_CAPPED
from sandboxes.subprocess._network import SandboxNetwork
from sandboxes.subprocess._outcome import outcome, shim_marks
from sandboxes.subprocess._prime import FdPipe
from sandboxes.subprocess._process import EXIT_GRACE_S, Driven, Ending, WholeLimits, drive
from sandboxes.subprocess._staged_folders import FolderId, NoNamespace, StagedFolders

if TYPE_CHECKING:
    from sandboxes.subprocess._tree import ProcessTree
    from sandboxes.subprocess.sandbox import SubprocessSandbox

# How long a sandbox started ahead may take to be set up before the pool moves on; one
# slower than that is still used, and its call reports whatever became of it.
STARTED_WAIT_S = 5.0


class PreparedSubprocess(OneRun):
    """One attempt's sandbox: its cgroup and identity exist; the process starts in ``run``
    (or ahead of it, ``start_waiting``)."""

    def __init__(
        self,
        owner: SubprocessSandbox,
        spec: LaunchSpec,
        limits: Limits,
        *,
        cgroup: CallCgroup | None,
        missing: tuple[str, ...],
        lease: IdentityLease,
        workspace: GrantedWorkspace | None,
        network: SandboxNetwork | None,
        scratch_root: Path | None,
        stage_id: FolderId | None,
    ) -> None:
        super().__init__(limits)
        self._owner = owner
        self._spec = spec
        self._cgroup = cgroup
        self._has_cgroup = cgroup is not None  # ``_cgroup`` is None again after the teardown
        self._missing = missing
        self._stage_id = stage_id  # set: start from the launch thread (``_staged_folders``)
        self._lease: IdentityLease | None = lease
        self._workspace = workspace
        self.network = network
        self._command = SandboxCommand(
            owner,
            spec,
            limits,
            hardened=not missing,
            uid=lease.uid,
            gid=lease.gid,
            cgroup=cgroup,
            network=network,
            workspace=workspace,
            scratch_root=scratch_root,
        )
        self._fds: list[int] = []
        self._teardown_lock = threading.Lock()
        self._pgid: int | None = None
        self._started_read: int | None = None
        # The launcher (started ahead of the call by ``start_waiting``, or by the call), and
        # the token the exec guard reads first.
        self._popen: subprocess.Popen[bytes] | None = None
        self._token = ""
        self._whole: WholeLimits | None = None  # made at the first ``_breached``
        self._tree: ProcessTree | None = None

    @property
    def uid(self) -> int:
        return self._command.uid

    async def attach_egress(self) -> None:
        """Hand the listener made in the sandbox's namespace to the call's egress proxy."""
        listener = self.network.take_listener() if self.network is not None else None
        if listener is not None:
            assert self._spec.egress is not None
            await self._spec.egress.attach(listener)

    async def _hold(self, exchange: Exchange, begun_at: Stage) -> SandboxOutcome:
        """Start the tool (or take the one started ahead) and let ``exchange`` speak with it.

        Raises:
            SandboxUnavailable: the launcher could not be started.
        """
        started: float | None = None
        if begun_at is Stage.PREPARED:
            # Cold: the timeout counts from the launch. Started the way a warm sandbox is
            # (its exit watched through a pidfd), not by asyncio's own subprocess support,
            # whose child watcher starts a thread per process.
            started = time.monotonic()
            await self._astart()
        popen = self._popen
        if popen is None:
            raise SandboxUnavailable("the sandbox was closed before its run")
        return await self._run_started(popen, exchange, started)

    # -- starting: ahead of the call (blocking) or for it (awaited) ----------------------

    def _start_ahead(self) -> None:
        """Start the tool now, blocked on its stdin until ``run`` writes the payload
        (blocking: the pool's thread). The exec guard's token goes in at once: it is this
        sandbox's own, and the sandbox serves one call only."""
        steps = self._start_steps()
        staged = next(steps, None)
        if staged is not None:
            with contextlib.suppress(StopIteration):
                steps.send(_tried(lambda: staged.run(self._start_staged)))
        # Ready once the sandbox is built and its shim runs (it then writes the started
        # byte, read by ``_drive`` later: only waited for here). This also paces the pool:
        # its next sandbox is not begun while this one still takes the CPU to set up.
        assert self._started_read is not None
        ready([self._started_read], STARTED_WAIT_S)
        tree = self._process_tree()
        if tree is not None:
            tree.look()  # its processes, while the launcher still holds them

    async def _astart(self) -> None:
        """Start the tool for a cold run (the launch thread awaited, not blocked on)."""
        steps = self._start_steps()
        staged = next(steps, None)
        if staged is not None:
            try:
                started_there = await staged.arun(self._start_staged)
            except NoNamespace:
                started_there = False
            with contextlib.suppress(StopIteration):
                steps.send(started_there)

    def _start_steps(self) -> Generator[StagedFolders, bool, None]:
        """The one way the tool starts, warm or cold: from the launch thread when the tool
        folder is to be bound there (yielded: the caller runs ``_start_staged`` on it,
        blocking or awaited, and sends back whether it started), else, or when it could
        not, from the caller's thread."""
        staged = self._owner.staged
        if self._stage_id is not None and staged is not None and (yield staged):
            return
        self._start()

    def _start_staged(self) -> bool:
        """``_start`` on the launch thread, with the tool folder bound in its namespace;
        False, and nothing started, when it cannot be bound there."""
        assert self._owner.staged is not None and self._stage_id is not None
        try:
            point = self._owner.staged.point(self._spec.tool_dir, self._stage_id)
        except OSError:
            point = None  # the launcher binds it for this call, and says what fails
        if point is None:
            return False
        self._start(point)
        return True

    def _start(self, staged_point: Path | None = None) -> None:
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
        launch = self._command.launch(staged_point)
        self._fds += launch.pipe
        self._started_read = launch.started_read
        try:
            popen = subprocess.Popen(
                launch.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=launch.env,
                cwd="/",
                start_new_session=True,
                pass_fds=launch.pass_fds,
                bufsize=0,
            )
        except (OSError, ValueError) as exc:
            raise SandboxUnavailable(f"cannot start the sandbox launcher: {type(exc).__name__}") from exc
        finally:
            for fd in launch.pass_fds:  # the launcher has its copies (or never will)
                os.close(fd)
        self._popen, self._pgid = popen, popen.pid
        assert popen.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # died already: its run says how
            popen.stdin.write(token_line(self._token))  # one line, far below PIPE_BUF: atomic

    # -- warm pools ----------------------------------------------------------------------

    def _opening_pipe(self, timeout_s: float) -> PrimingPipe:
        assert self._popen is not None  # WAITING: started
        return FdPipe(self._popen, self._limits.max_output_bytes, timeout_s)

    def interrupt(self) -> None:
        self._kill_now()  # the prime reads the end of stdout at once

    def discard(self) -> None:
        self._stage = Stage.CLOSED
        self._kill_now()
        self._close_fds()
        self._teardown()

    # -- the run -------------------------------------------------------------------------

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

    async def _drive(self, proc: Driven, exchange: Exchange, token: str, started: float) -> SandboxOutcome:
        try:
            result = await drive(
                proc,
                exchange,
                b"",  # the token line is in already (``_start``)
                self._limits.timeout_ms / 1000,
                self._kill_now,
                self._breached_limit(exchange.stderr),
            )
        finally:
            marks = shim_marks(self._started_read) if self._started_read is not None else b""
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
                degraded=bool(self._missing),
                missing=self._missing,
            )
        return outcome(
            result,
            marks.startswith(b"s"),
            token,
            duration_ms,
            not exchange.ends_by_exit,
            missing=self._missing,
            cgroup=self._cgroup,
            limits=self._limits,
            pids_capped=PIDS_CAPPED in marks,
        )

    def _breached_limit(self, stderr: StderrSplitter) -> Callable[[], Ending | None] | None:
        """What polls the tool's limits as a whole: its cgroup's counters, or rootless
        without one, the sums over its processes and what its stderr says (``_tree``)."""
        if self._cgroup is not None:
            return self._breached
        tree = self._process_tree()
        return tree.watch(stderr) if tree is not None else None

    def _process_tree(self) -> ProcessTree | None:
        """Rootless without a cgroup: the processes under the launcher, which stand for it."""
        if self._tree is None and self._owner.rlimits_only and self._popen is not None:
            from sandboxes.subprocess._tree import ProcessTree  # psutil: only rootless runs pay for it

            self._tree = ProcessTree(self._popen.pid, self._limits)
        return self._tree

    def limit_broken(self) -> bool:
        """Between a session's calls: a limit of the sandbox as a whole already broken."""
        if self._cgroup is not None:
            return self._breached() is not None
        tree = self._process_tree()
        return tree is not None and tree.breached() is not None

    def _breached(self) -> Ending | None:
        """A limit of the tool as a whole that is already broken (polled while it runs)."""
        assert self._cgroup is not None
        if self._whole is None:
            self._whole = WholeLimits(self._cgroup, self._limits.cpu_seconds)
        return self._whole.breached()

    # -- the end -------------------------------------------------------------------------

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

    def _close_fds(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def ended(self) -> str | None:
        """``Waits.ended``: from the launcher's status, which stays unreaped for the run."""
        if self._popen is None or self._popen.returncode is not None:
            return None if self._popen is None else "it ended"
        return process_ended(self._popen.pid, not self._missing)

    def limit_broken_while_waiting(self) -> str | None:
        """``WatchedWhileWaiting``: rootless without a cgroup, the sums over its processes."""
        if self._cgroup is not None or self._popen is None or self._popen.returncode is not None:
            return None
        tree = self._process_tree()
        broken = tree.breached() if tree is not None else None
        what = "memory" if broken is Ending.MEMORY_LIMIT else "CPU"
        return None if broken is None else f"its processes together passed its {what} limit"

    def used_cpu_seconds(self) -> float | None:
        if self._cgroup is not None:
            return self._cgroup.cpu_seconds()
        tree = self._process_tree()
        return tree.cpu_seconds() if tree is not None else None

    async def close(self) -> None:
        self._stage = Stage.CLOSED
        self._kill_now()
        self._close_fds()
        if self._all_dead():
            # Only empty folders and bookkeeping are left: off the call's path (a cgroup
            # rmdir and a thread hop on this loop).
            self._owner.teardowns.submit(self._teardown)
            return
        # Waiting for a fork bomb's last members to die, applying staged writes: blocking
        # work, in one of the backend's own threads (a synchronous call's fresh loop would
        # start a thread for it, and another to join that one). Once handed over it
        # finishes even if this close is cancelled.
        try:
            done = submit(self._owner.closers.pool(), self._teardown)
        except SandboxUnavailable:  # the backend is closing: still torn down before the answer
            await asyncio.to_thread(self._teardown)
            return
        await asyncio.shield(asyncio.wrap_future(done))

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
            tree = self._process_tree()
            if tree is not None:  # what a cgroup's removal does: kill, and wait till gone
                tree.kill_all(EXIT_GRACE_S)
            if self._cgroup is not None:
                self._cgroup.remove()  # kills until empty, then removes
                self._cgroup = None
        finally:
            self._reap_started()
            try:
                self._command.remove_scratch()
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


def _tried(start_there: Callable[[], bool]) -> bool:
    """Whether ``start_there`` started the tool on the launch thread; False when that
    thread has no mount namespace here."""
    try:
        return start_there()
    except NoNamespace:
        return False
