"""One attempt's container, from its creation to its removal.

While the container runs its cgroup is polled, so a limit broken by any of its processes
ends the attempt with that limit's reason.

A warm container (``prestart``) goes as far ahead of its call as the payload allows:
created, attached, started, its cgroup completed and its gate released, so its tool
waits on stdin; its run writes the payload and attends as a cold one, the timeout
counting from the payload. It serves that one call and is removed after it. A warm
container of an MCP server may also be primed (``prime``: its ``initialize`` said ahead
through the attach socket, ``sandboxes._priming``); its dialogue then starts past it.
The stages it goes through are ``sandboxes._prepared.Stage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import math
import socket
import time
from typing import TYPE_CHECKING, Any

from sandboxes._deferred import DeferredTeardown
from sandboxes._exchange import Exchange
from sandboxes._exec_status import new_token
from sandboxes._identity import IdentityLease
from sandboxes._netns_sockets import SandboxSockets
from sandboxes._prepared import OneRun, Stage
from sandboxes._priming import PrimingPipe
from sandboxes._socket_memory import tcp_budget
from sandboxes._streams import OutputOverflow
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import (
    EgressEndpoint,
    Limits,
    OpeningFailed,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
)
from sandboxes.docker._attach import Attached, SocketStdin, StdoutValve, drain, hang_up, read_frames
from sandboxes.docker._cgroup import ContainerCgroup
from sandboxes.docker._checks import TCP_V1_PROBLEM
from sandboxes.docker._client import daemon_call, daemon_failures
from sandboxes.docker._container import remove_container
from sandboxes.docker._egress import listener_in
from sandboxes.docker._outcome import outcome
from sandboxes.docker._prime import SocketPipe
from sandboxes.events import StderrSplitter

if TYPE_CHECKING:
    from docker import APIClient

# After the output ends, the exit status is a moment away; bound the wait anyway.
EXIT_GRACE_S = 5.0
# How often the container's cgroup is read: CPU time, OOM kills and refused forks of all
# its processes. A fork bomb that gives up and exits within one poll can still slip past.
LIMITS_POLL_S = 0.02
# After the gate's trailer its shell and the container's init exit at once; a container
# still running this long after is killed (see ``PreparedContainer._settled``).
SETTLE_S = 0.25
SETTLE_POLL_S = 0.001


class PreparedContainer(OneRun):
    """One attempt's container: created, not started; its uid and workspace held until
    ``close`` removes it."""

    def __init__(
        self,
        client: APIClient,
        container_id: str,
        limits: Limits,
        *,
        cgroup_v1: bool,
        release: bytes,
        teardowns: DeferredTeardown | None,
        egress: EgressEndpoint | None,
        cgroup_shows_processes: bool,
        lease: IdentityLease,
        workspace: GrantedWorkspace | None,
    ) -> None:
        super().__init__(limits)
        self._client = client
        self._teardowns = teardowns
        self._dead = False  # every process of the container is known to have ended
        # Its processes, and only they, are in its cgroup (not under another OCI runtime).
        self.cgroup_shows_processes = cgroup_shows_processes
        self._release = release
        self.container_id = container_id
        self._cgroup_v1 = cgroup_v1
        self._closed = False
        self._lease: IdentityLease | None = lease  # None once given back
        self._workspace = workspace  # None once released
        self._pids_refused = 0
        self._oom_killed = False
        self._sockets = SandboxSockets(tcp_budget(limits.memory_mb))  # what its cgroup does not count
        self.egress = egress
        self._waiting: Attached | None = None  # WAITING or PRIMED: started ahead of its call

    async def _hold(self, exchange: Exchange, begun_at: Stage) -> SandboxOutcome:
        """Start the container (or take the one started ahead) and let ``exchange`` speak
        with its tool until the run ends.

        Raises:
            SandboxUnavailable: the daemon failed, or the connection to it was lost.
        """
        started = time.monotonic()
        stderr = exchange.stderr
        attached, self._waiting = self._waiting, None
        if begun_at is not Stage.PREPARED and attached is None:
            raise SandboxUnavailable("the container was removed before its run")
        try:
            if attached is None:
                attached = await self._start()
            # The timeout counts from here (``_attend``): for a warm container, the
            # moment of the payload (or the dialogue's start), whenever it was started.
            preamble, attached.unsent = attached.unsent, b""
            ending = await self._attend(attached, exchange, preamble, stderr)
            if ending is _FINISHED:
                # The daemon copies stdout and stderr apart: what the tool wrote on stderr
                # before its last answer may still be on its way. Kill, then read on (bounded).
                await asyncio.to_thread(self._kill)
                await drain(attached)
        except OSError as exc:
            await asyncio.to_thread(self._kill)
            message = f"lost the connection to the Docker daemon: {type(exc).__name__}"
            raise SandboxUnavailable(message) from exc
        finally:
            if attached is not None:
                await hang_up(attached)
        if ending is not _OUTPUT_ENDED and ending is not _FINISHED:
            await asyncio.to_thread(self._kill)
        duration_ms = (time.monotonic() - started) * 1000
        if ending is _FINISHED:
            # The dialogue's end, not the tool's: its status is that of our kill.
            return SandboxOutcome(None, None, b"", stderr.text(), duration_ms)
        state = await self._settled(attached) if attached.said is not None else None
        if state is None:
            state = await asyncio.to_thread(self._final_state)
        self._dead = "ExitCode" in state and not state.get("Running")
        reason = ending if isinstance(ending, StopReason) else None
        told = outcome(
            state, reason, exchange.output(), stderr, attached.token, duration_ms, not exchange.ends_by_exit
        )
        return self._blame_limits(told)

    async def _start(self) -> Attached:
        """Attach, start, complete the cgroup and put the egress proxy in place; the tool
        is still held by the gate, its release left for ``run`` to write."""
        with daemon_call("attach to the container"):
            sock = await asyncio.to_thread(self._attach_socket)
        attached = Attached(sock, new_token())
        try:
            with daemon_call("start the container"):
                await asyncio.to_thread(self._client.start, self.container_id)
            attached.cgroup = await asyncio.to_thread(self._complete_cgroup)
            await self._attach_egress()
        except BaseException:
            attached.close()
            raise
        attached.unsent = attached.release(self._release)
        return attached

    # -- started ahead of the call (warm pools) -----------------------------------------

    def _start_ahead(self) -> None:
        """Start the container now and release its tool from the gate, so that it waits
        on stdin for the payload ``run`` writes (blocking: the pool's thread). The cgroup
        is complete before the release, as for a cold run; the exec guard's token is this
        container's own, and the container serves one call only.

        Raises:
            SandboxUnavailable: the daemon failed, or the cgroup could not be completed.
        """
        with daemon_call("attach to the container"):
            sock = self._attach_socket()
        attached = Attached(sock, new_token())
        try:
            with daemon_call("start the container"):
                self._client.start(self.container_id)
            attached.cgroup = self._complete_cgroup()
            with daemon_call("release the started container"):
                attached.raw.sendall(attached.release(self._release))
        except BaseException:
            attached.close()
            raise
        self._waiting = attached

    def _opening_pipe(self, timeout_s: float) -> PrimingPipe:
        attached = self._waiting
        if attached is None:  # WAITING: started ahead, so never
            raise OpeningFailed("the container started ahead is gone")
        return SocketPipe(attached.raw, attached.decoder, self._limits.max_output_bytes, timeout_s)

    def interrupt(self) -> None:
        attached = self._waiting
        if attached is not None:
            with contextlib.suppress(OSError):  # the prime's recv returns b"" at once
                attached.raw.shutdown(socket.SHUT_RDWR)

    def discard(self) -> None:
        self._stage = Stage.CLOSED
        self._teardown()

    def _waiting_cgroup(self) -> ContainerCgroup | None:
        return self._waiting.cgroup if self._waiting is not None else None

    def ended(self) -> str | None:
        """``Waits.ended``: its processes are gone from its cgroup (not told under gVisor)."""
        cgroup = self._waiting_cgroup() if self.cgroup_shows_processes else None
        return "its container stopped" if cgroup is not None and cgroup.empty() else None

    def used_cpu_seconds(self) -> float | None:
        cgroup = self._waiting_cgroup() if self.cgroup_shows_processes else None
        return cgroup.cpu_seconds() if cgroup is not None else None

    def limit_broken(self) -> bool:
        """Between a session's calls: a limit of the container as a whole already broken."""
        cgroup = self._waiting_cgroup()
        return cgroup is not None and self._breach(cgroup) is not None

    def _attach_socket(self) -> Any:
        """The container's stdin, stdout and stderr as one socket (blocking)."""
        params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        return self._client.attach_socket(self.container_id, params=params)

    async def _attach_egress(self) -> None:
        """Put the call's egress proxy on the container's loopback; the tool is still gated."""
        if self.egress is None:
            return
        try:
            listener = await asyncio.to_thread(listener_in, self._client, self.container_id, self.egress.port)
            await self.egress.attach(listener)
        except BaseException:
            await asyncio.to_thread(self._kill)
            raise

    def _complete_cgroup(self) -> ContainerCgroup | None:
        """Find the container's cgroup on this host and, on v1, cap its TCP buffers; the
        tool is still held by the gate. None when the daemon is not local (v2 only).

        Raises:
            SandboxUnavailable: on v1, the TCP limit cannot be set (the container is
            killed and the tool never gets its input).
        """
        cgroup = ContainerCgroup.find(self.container_id)
        if not self._cgroup_v1:
            return cgroup
        problem: Exception | None = None
        if cgroup is not None:
            try:
                cgroup.limit_tcp_memory(tcp_budget(self._limits.memory_mb))
            except OSError as exc:
                problem = exc
        if cgroup is None or problem is not None:
            self._kill()
            raise SandboxUnavailable(
                f"cannot limit the container's TCP buffers: {TCP_V1_PROBLEM}"
            ) from problem
        return cgroup

    async def _attend(
        self, attached: Attached, exchange: Exchange, preamble: bytes, stderr: StderrSplitter
    ) -> StopReason | _End:
        """Exchange with the tool until its output ends (``_OUTPUT_ENDED``), the exchange
        ends the run (``_FINISHED``), the container as a whole breaks a limit, the output
        overflows or the timeout passes (that limit's reason)."""
        cgroup = attached.cgroup
        talk = asyncio.ensure_future(self._exchange(attached, exchange, preamble, stderr))
        watcher = asyncio.ensure_future(self._watch(cgroup)) if cgroup is not None else None
        tasks = {talk} if watcher is None else {talk, watcher}
        try:
            timeout = self._limits.timeout_ms / 1000
            await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if talk.done():
                if isinstance(talk.exception(), OutputOverflow):
                    return StopReason.OUTPUT_LIMIT
                ending = talk.result()  # a lost connection (OSError) goes up
                if cgroup is not None and ending is _OUTPUT_ENDED:
                    # A tool that hit a limit and exited within the last poll: one more
                    # look while the cgroup is (most often) still there.
                    self._breach(cgroup)
                return ending
            if watcher is not None and watcher.done():
                return watcher.result()
            if cgroup is not None and (breach := self._breach(cgroup)) is not None:
                return breach  # broken within the last poll before the timeout
            return StopReason.TIMEOUT
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, cgroup: ContainerCgroup) -> StopReason:
        """Poll the cgroup until a limit that ends the attempt at once is broken."""
        while (breach := self._breach(cgroup)) is None:
            await asyncio.sleep(LIMITS_POLL_S)
        return breach

    def _breach(self, cgroup: ContainerCgroup) -> StopReason | None:
        """CPU time over the budget, an OOM kill or socket buffers past their share, over all
        the container's processes; a refused fork is only noted (a tool may cope with it).
        Reads 0 once the cgroup is gone."""
        self._pids_refused = max(self._pids_refused, cgroup.pids_refused())
        if cgroup.oom_kills() > 0 or cgroup.sockets_overran() or self._sockets.over_budget(cgroup.members):
            self._oom_killed = True
            return StopReason.MEMORY_LIMIT
        if cgroup.cpu_seconds() > self._limits.cpu_seconds:
            return StopReason.CPU_LIMIT
        return None

    def _blame_limits(self, outcome: SandboxOutcome) -> SandboxOutcome:
        """A failure after a limit was hit is that limit's, not a plain exit or timeout; a
        success after the memory limit broke (an OOM kill, sockets past their share, see
        ``sandboxes._socket_memory``) within the last poll is not one."""
        if outcome.reason is None and self._oom_killed:
            return dataclasses.replace(outcome, reason=StopReason.MEMORY_LIMIT)
        if outcome.reason not in (StopReason.EXIT_CODE, StopReason.SIGNAL, StopReason.TIMEOUT):
            return outcome
        if self._oom_killed:
            return dataclasses.replace(outcome, reason=StopReason.MEMORY_LIMIT)
        if self._pids_refused:
            return dataclasses.replace(outcome, reason=StopReason.PIDS_LIMIT)
        return outcome

    async def _exchange(
        self, attached: Attached, exchange: Exchange, preamble: bytes, stderr: StderrSplitter
    ) -> _End:
        """Let ``exchange`` speak while the frames are read: ``_OUTPUT_ENDED`` at the end of
        the output (the container exited), ``_FINISHED`` when the exchange ends the run.

        Raises:
            OutputOverflow: stdout passed the cap.
            OSError: the connection to the daemon was lost.
        """
        raw = attached.raw
        raw.setblocking(False)
        speaker = asyncio.ensure_future(exchange.speak(SocketStdin(raw), preamble))
        shows = self.cgroup_shows_processes
        stdout = StdoutValve(exchange.stdout)
        reader = asyncio.ensure_future(
            read_frames(raw, attached.decoder, stdout, stderr, attached.gate_token, shows)
        )
        watched: set[asyncio.Future[Any]] = {speaker, reader, stdout.overflowed}
        try:
            while True:
                done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if speaker in done:
                    watched.discard(speaker)
                    if speaker.result():
                        stdout.shut()
                        attached.reader = reader  # for ``drain``, uncancelled
                        return _FINISHED
                if stdout.overflowed.done():  # the reader, read on, may be done too
                    raise OutputOverflow
                if reader in done:
                    attached.said = reader.result()
                    return _OUTPUT_ENDED
        finally:
            tasks = {speaker} if attached.reader is reader else {speaker, reader}
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)  # never raises their ends; our own cancellation goes up

    async def _settled(self, attached: Attached) -> dict[str, Any] | None:
        """The state the gate's trailer said, once the container's cgroup is empty (the
        gate and its init exit right after the trailer: well within ``SETTLE_S``); None
        when that cannot be seen (a remote daemon), or the container still runs past it
        (a tool that forged the trailer): then it is killed and the daemon says how it
        ended."""
        cgroup = attached.cgroup
        if cgroup is None or not self.cgroup_shows_processes:
            return None
        loop = asyncio.get_running_loop()
        settle_by = loop.time() + SETTLE_S
        while not cgroup.empty():
            if loop.time() > settle_by:
                await asyncio.to_thread(self._kill)
                return None
            await asyncio.sleep(SETTLE_POLL_S)
        self._breach(cgroup)  # a limit broken in the last moments (the cgroup is still there)
        return {"ExitCode": attached.said, "Running": False}

    def _kill(self) -> None:
        # Best effort: a container that already exited answers 409; close() removes it anyway.
        with contextlib.suppress(*daemon_failures()):
            self._client.kill(self.container_id)

    def _final_state(self) -> dict[str, Any]:
        """The container's state; empty when the daemon cannot tell (then the outcome is
        ``sandbox_unavailable``). Any other exception is a bug and goes up."""
        state = self._inspect_state()
        if state.get("Running"):  # most often it has exited by the end of its output: one round trip
            with contextlib.suppress(*daemon_failures()):  # a wait past the grace: inspect tells
                self._client.wait(self.container_id, timeout=math.ceil(EXIT_GRACE_S))
            state = self._inspect_state()
        return state

    def _inspect_state(self) -> dict[str, Any]:
        try:
            inspected = self._client.inspect_container(self.container_id)
        except daemon_failures():
            return {}
        return dict(inspected["State"])

    async def close(self) -> None:
        self._stage = Stage.CLOSED
        if not self._dead or self._waiting is not None or self._teardowns is None:
            await asyncio.to_thread(self._teardown)
            return
        # Every process of the container has ended: staged writes are applied now, on the
        # call's path; removing the dead container (~10 ms of daemon work) and giving back
        # its uid are not (``sandboxes._deferred``; the backend's ``aclose`` waits for them).
        workspace, self._workspace = self._workspace, None
        if workspace is not None:
            await asyncio.to_thread(workspace.release)
        self._teardowns.submit(self._teardown)

    def _teardown(self) -> None:
        """Remove the container, then give back what it held (blocking). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._sockets.close()
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.close()
        try:
            remove_container(self._client, self.container_id)
        finally:
            try:
                workspace, self._workspace = self._workspace, None
                if workspace is not None:
                    workspace.release()  # applies staged writes
            finally:
                if self._lease is not None:
                    self._lease.release()  # the container, and every process of that uid, is gone
                    self._lease = None


class _End(enum.Enum):
    OUTPUT_ENDED = "output_ended"  # the container exited: its state says how
    FINISHED = "finished"  # the exchange ended the run: a dialogue's ``talk`` returned


_OUTPUT_ENDED, _FINISHED = _End.OUTPUT_ENDED, _End.FINISHED
