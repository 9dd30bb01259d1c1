"""A docker session sandbox: one container kept for the calls of one session, each call
running the tool's command again inside it through ``docker exec``.

The container is prepared and started as a warm one is (``PreparedContainer``: its
cgroup completed, the gate released), with a holder in place of the tool: a shell that
reads the attach socket until it closes. So the container lives while the runner holds
that socket, and ends with it should the runner die (its labels leave it to the
watchdog and the next runner's sweep besides). Each call is an exec of the same gate
(``_container.GATE``) with the tool's command, as the container's user, in its working
directory and environment; the gate reads its own token, the secrets and the exec
guard's token on stdin, then the payload, and says how the tool ended in its trailer.
The exec is attended as a cold run is (``PreparedContainer._attend``): the timeout, the
output cap, the limits of the whole container (memory, pids, CPU time adding up over
the session). A call that does not end by its own exit ends the session: the container
is killed, every process of it with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from sandboxes._exchange import PayloadExchange
from sandboxes._exec_status import new_token
from sandboxes.base import (
    LaunchSpec,
    Limits,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
    WorkspaceNotApplied,
)
from sandboxes.cancellation import finish_shielded
from sandboxes.docker._attach import Attached, hang_up
from sandboxes.docker._client import daemon_call, daemon_failures
from sandboxes.docker._container import GATE, PLAIN_GATE
from sandboxes.docker._outcome import outcome
from sandboxes.events import EventSink
from sandboxes.session import BetweenCalls, SessionEnd
from sandboxes.view import TOOL_MOUNT

if TYPE_CHECKING:
    from sandboxes.docker._prepared import PreparedContainer
    from sandboxes.docker.sandbox import DockerSandbox

# The container's own program while the session lasts: reads its stdin (the attach
# socket, which the runner writes nothing more to) until it closes, so the container
# ends with the runner's end of that socket.
HOLDER = ("/bin/sh", "-c", "while read -r _; do :; done")
# Outcomes that mean the runner cut the call short, or a limit of the whole session broke.
_ENDS_SESSION = frozenset(
    {
        StopReason.TIMEOUT,
        StopReason.OUTPUT_LIMIT,
        StopReason.MEMORY_LIMIT,
        StopReason.CPU_LIMIT,
        StopReason.PIDS_LIMIT,
        StopReason.SANDBOX_UNAVAILABLE,
    }
)


async def open_session(owner: DockerSandbox, spec: LaunchSpec, limits: Limits) -> DockerSession:
    """Prepare and start a session container for ``spec`` (``HoldsSessions.open_session``).

    Raises:
        SandboxUnavailable: as ``prepare``; or the container could not be started.
    """
    if spec.egress is not None:
        raise SandboxUnavailable("a session sandbox cannot use the egress proxy, which lives for one call")
    prepared = await owner.prepare(dataclasses.replace(spec, command=HOLDER), limits)
    session = DockerSession(prepared, spec, limits, plain=bool(spec.runtime or owner.config.runtime))
    try:
        await finish_shielded(asyncio.to_thread(prepared.start_waiting))
        session.start_ahead()
    except BaseException:
        with contextlib.suppress(WorkspaceNotApplied):  # what failed the opening is what is said
            await finish_shielded(session.close())
        raise
    return session


class DockerSession:
    """``SessionSandbox`` of the docker backend."""

    def __init__(self, prepared: PreparedContainer, spec: LaunchSpec, limits: Limits, *, plain: bool) -> None:
        self._prepared = prepared
        self._command = ["/bin/sh", "-c", PLAIN_GATE if plain else GATE, "sh", *spec.command]
        self._limits = limits
        self._end: SessionEnd | None = None
        self._busy = False
        self._ahead: asyncio.Task[tuple[str, Attached]] | None = None  # the next call's exec
        self._between = BetweenCalls()

    def start_ahead(self) -> None:
        """Start the next call's exec now, off the call's path: its gate released, the
        tool starts up and waits on its stdin for the payload."""
        self._ahead = asyncio.get_running_loop().create_task(asyncio.to_thread(self._exec))

    def ended(self) -> SessionEnd | None:
        if self._end is None and self._prepared.ended() is not None:
            self._end = SessionEnd.DIED
        # Between calls a process a call left may keep using CPU or memory, and no call's
        # poll looks then.
        if self._end is None and not self._busy and self._between.due() and self._prepared.limit_broken():
            self._end = SessionEnd.LIMIT  # killed by its ``close``: never blocks here
        return self._end

    async def run(self, payload: bytes, timeout_ms: int, events: EventSink | None = None) -> SandboxOutcome:
        if self.ended() is not None:
            raise SandboxUnavailable(f"the session sandbox has ended ({self._end})")
        if self._busy:
            raise SandboxUnavailable("a session sandbox serves one call at a time")
        self._busy = True
        try:
            return await self._call(payload, timeout_ms, events)
        finally:
            self._busy = False

    async def _call(self, payload: bytes, timeout_ms: int, events: EventSink | None) -> SandboxOutcome:
        prepared = self._prepared
        prepared.set_timeout(timeout_ms)  # the rest of the limits hold for the whole session
        exchange = PayloadExchange(payload, self._limits.max_output_bytes, events)
        stderr = exchange.stderr
        if self._ahead is None:
            self.start_ahead()
        assert self._ahead is not None
        try:
            with daemon_call("exec in the session's container"):
                # Shielded: a call cancelled here leaves the exec to the next call (or ``close``).
                exec_id, attached = await asyncio.shield(self._ahead)
            self._ahead = None
        except SandboxUnavailable:
            self._ahead = None
            await asyncio.to_thread(self.kill, SessionEnd.DIED)
            raise
        started = time.monotonic()  # the timeout counts from the payload, as for a warm call
        try:
            holder = prepared._waiting
            attached.cgroup = holder.cgroup if holder is not None else None
            try:
                ending = await prepared._attend(attached, exchange, b"", stderr)
            except OSError as exc:
                await asyncio.to_thread(self.kill, SessionEnd.DIED)
                raise SandboxUnavailable(
                    f"lost the connection to the Docker daemon: {type(exc).__name__}"
                ) from exc
            except BaseException:  # cancelled: the call's processes may still run
                await finish_shielded(asyncio.to_thread(self.kill, SessionEnd.LIMIT))
                raise
        finally:
            try:
                await hang_up(attached)
            finally:
                stderr.close()
        reason = ending if isinstance(ending, StopReason) else None
        state: dict[str, Any] = {"ExitCode": attached.said, "Running": False}
        if reason is None and attached.said is None:  # no trailer (another runtime): the daemon says
            state = await asyncio.to_thread(self._exec_state, exec_id)
        duration_ms = (time.monotonic() - started) * 1000
        told = outcome(state, reason, exchange.output(), stderr, attached.token, duration_ms)
        told = prepared._blame_limits(told)
        if told.reason in _ENDS_SESSION:
            await asyncio.to_thread(self.kill, SessionEnd.LIMIT)
        else:
            self.start_ahead()
        return told

    def _exec(self) -> tuple[str, Attached]:
        """Start the gate once more inside the container, attached, and write its release
        (blocking)."""
        prepared = self._prepared
        client = prepared._client
        lease = prepared._lease
        if lease is None:
            raise SandboxUnavailable("the session's container is closed")
        created = client.exec_create(
            prepared.container_id,
            self._command,
            stdout=True,
            stderr=True,
            stdin=True,
            tty=False,
            user=f"{lease.uid}:{lease.gid}",  # the container's own uid
            workdir=TOOL_MOUNT,
        )
        attached = Attached(client.exec_start(created["Id"], socket=True), new_token())
        try:
            attached.raw.sendall(attached.release(prepared._release))
        except BaseException:
            attached.close()
            raise
        return str(created["Id"]), attached

    def _exec_state(self, exec_id: str) -> dict[str, Any]:
        """How the exec ended, as the daemon tells it; empty when it cannot (then the
        outcome is ``sandbox_unavailable``)."""
        try:
            inspected = self._prepared._client.exec_inspect(exec_id)
        except daemon_failures():
            return {}
        return {"ExitCode": inspected.get("ExitCode"), "Running": inspected.get("Running")}

    def kill(self, why: SessionEnd) -> None:
        """End the session now: the container is killed, every process of it (blocking,
        one round trip to the daemon)."""
        if self._end is None:
            self._end = why
        self._prepared._kill()

    async def close(self) -> None:
        if self._end is None:
            self._end = SessionEnd.DIED
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # its thread cannot be stopped: its socket is closed once it is done
            with contextlib.suppress(Exception):
                _, attached = await finish_shielded(ahead)
                attached.close()
        await self._prepared.close()
