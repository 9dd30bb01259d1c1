"""A hosted MCP server kept for a session: one run of it, whose conversation the
session's calls share.

``HostedServer`` is opened by a session's first call of the server's tools: the server is
started in a sandbox prepared as any call's (``prepare``, then ``converse`` with a
``HeldDialogue``, which initializes it once), and the run is held in a task. Each call
then speaks one ``tools/call`` in that conversation, under its own timeout. The run's
limits (memory, pids, CPU, disk) hold for the whole session; its timeout is the session's
``max_ms``, and its stdout may carry ``SESSION_OUTPUT_CALLS`` calls' worth of output.

A call that times out or is cut short ends the server (its request may still be running
in it: a server is never left to finish what nobody waits for); a server that exits, is
killed or breaks the protocol ends too. Either way ``ended`` says so and the session's
next call starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time

from runner.call.hosting import HeldDialogue, HostedDialogue
from sandboxes import (
    Converses,
    LaunchSpec,
    Limits,
    PreparedSandbox,
    Sandbox,
    SandboxOutcome,
    SandboxUnavailable,
    SessionEnd,
    StopReason,
)
from sandboxes.cancellation import finish_shielded

# The server's stdout over a session may carry this many calls' ``max_output_bytes``;
# past it the server is killed (a limit), as one call's would be.
SESSION_OUTPUT_CALLS = 1000


class HostedServer:
    """One hosted server held for a session (``ended`` and ``close`` as a session sandbox)."""

    def __init__(self, prepared: PreparedSandbox, held: HeldDialogue) -> None:
        if not isinstance(prepared, Converses):
            raise TypeError("a hosted server needs a sandbox that converses")
        self._prepared = prepared
        self._held = held
        self._run: asyncio.Task[SandboxOutcome] = asyncio.ensure_future(prepared.converse(held))
        self._end: SessionEnd | None = None

    @classmethod
    async def open(
        cls, backend: Sandbox, spec: LaunchSpec, limits: Limits, held: HeldDialogue, max_ms: int
    ) -> HostedServer:
        """Start the server for a session of at most ``max_ms``.

        Raises:
            SandboxUnavailable: as ``prepare``, the backend cannot host MCP servers, or
                the call's network goes through the egress proxy.
        """
        if spec.egress is not None:  # attached to the run, it would end with the first call
            raise SandboxUnavailable(
                "a session's server cannot use the egress proxy, which lives for one call"
            )
        session_limits = dataclasses.replace(
            limits, timeout_ms=max_ms, max_output_bytes=limits.max_output_bytes * SESSION_OUTPUT_CALLS
        )
        held.cap_calls(limits.max_output_bytes)  # the run's cap is the session's; each call has its own
        prepared = await backend.prepare(spec, session_limits)
        if not isinstance(prepared, Converses):
            await finish_shielded(prepared.close())
            raise SandboxUnavailable(f"the {backend.name} backend cannot host MCP servers")
        return cls(prepared, held)

    def ended(self) -> SessionEnd | None:
        if self._end is None and self._run.done():
            self._end = SessionEnd.DIED
        return self._end

    async def call(self, dialogue: HostedDialogue, timeout_ms: int, max_output_bytes: int) -> SandboxOutcome:
        """Speak ``dialogue`` with the server within ``timeout_ms``, reading at most
        ``max_output_bytes`` for it (the calling tool's own cap, whichever tool opened the
        run): an outcome as a call's own run would give (``settled`` by the dialogue after).

        Raises:
            SandboxUnavailable: the server has ended.
            asyncio.CancelledError: the call was cancelled; the server is killed.
        """
        if self.ended() is not None:
            raise SandboxUnavailable("the session's server has ended")
        started = time.monotonic()
        self._held.cap_calls(max_output_bytes)  # calls take turns: this is the next one served
        speaking = asyncio.ensure_future(self._held.serve(dialogue))
        try:
            done, _ = await asyncio.wait(
                {speaking, self._run}, timeout=timeout_ms / 1000, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            speaking.cancel()
            self._end = SessionEnd.LIMIT
            self._run.cancel()
            raise
        duration = (time.monotonic() - started) * 1000
        if speaking in done and speaking.exception() is None:
            return SandboxOutcome(0, None, b"", "", duration)
        speaking.cancel()
        if not done:  # the timeout passed: the server goes, and its request with it
            self._end = SessionEnd.LIMIT
            self._run.cancel()
            message = f"the call timed out after {timeout_ms} ms"
            return SandboxOutcome(None, None, b"", "", duration, StopReason.TIMEOUT, message)
        # The conversation is over: the server died, or broke the protocol (the run's end
        # follows at once: the backend kills a server whose conversation ended).
        self._end = SessionEnd.DIED
        outcome = await finish_shielded(self._run)
        return dataclasses.replace(outcome, duration_ms=duration)

    async def close(self) -> None:
        """Kill the server and release its sandbox. Safe to call twice."""
        if self._end is None:
            self._end = SessionEnd.DIED
        self._run.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await finish_shielded(self._run)
        await finish_shielded(self._prepared.close())


def run_settings(backend: Sandbox, spec: LaunchSpec, limits: Limits) -> str:
    """A digest of what shapes a hosted server's run beyond one call (its backend, runtime,
    image, workspace, grants, secrets and limits, not the call's own timeout and output
    cap): the tools of one server whose policy differs in it never share a run, so no
    call runs with another tool's isolation or grants."""
    shape = (
        backend.name,
        spec.command,
        spec.image,
        spec.runtime,
        str(spec.workspace),
        spec.workspace_mode,
        spec.egress is not None,
        secrets_digest(spec),
        dataclasses.replace(limits, timeout_ms=0, max_output_bytes=0),
    )
    return hashlib.sha256(repr(shape).encode()).hexdigest()


def secrets_digest(spec: LaunchSpec) -> str:
    """A digest of the secrets' values a sandbox is opened with: a session sandbox keeps
    its first call's, which a later call's scrub, knowing only its own, would not mask."""
    return hashlib.sha256(repr(sorted(spec.secrets.items())).encode()).hexdigest()
