"""Session sandboxes of the runner: one per (session, tool), kept between that session's calls.

A ``CallSession`` is one conversation (``Runner.session()``, or one MCP client session of
``runner serve``). A call of a session tool (``session: true`` in its manifest, or
``tools.NAME.session`` in the policy) made in it runs in that session's sandbox of the
tool, opened by its first call; a call outside a session runs as any other. A sandbox
ends when its session ends (``ended``), after ``session.idle_ms`` without a call
(``idle``), ``session.max_ms`` after it opened (``max_ms``), when a call broke a limit,
timed out or was cut short (``limit``: the backend killed it whole), when its limits
could not be looked at between calls (``fault``), when it ended by itself between calls
(``died``), when a secret of the tool has another value than it was opened with
(``secrets``), or when the runner closes (``runner_closed``). A hosted MCP server's tools
marked so share one run of the server per session (``runner.call.hosted_sessions``), keyed
by the server's name apart from the tools' (a tool and a server of one name never share a
sandbox); a server that ends by itself closes with ``server_died``. The session's next
call of that tool opens a new one and says so (``sessionRestarted``). ``SessionCounts``
bounds the open sandboxes, in all (``session.max_total``) and per client
(``session.max_per_token``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from runner.audit.log import AuditLog
from runner.call.hosted_sessions import HostedServer, run_settings, secrets_digest
from runner.call.hosting import HostedDialogue, HostedWork
from runner.call.policy import Policy, SessionModel
from runner.call.session_counts import SessionCounts
from runner.clock import Clock
from runner.tools.manifest import Tool
from sandboxes import (
    Dialogue,
    HoldsSessions,
    LaunchSpec,
    Limits,
    PreparedSandbox,
    Sandbox,
    SandboxOutcome,
    SandboxUnavailable,
    SessionEnd,
    SessionSandbox,
    WorkspaceNotApplied,
)
from sandboxes.cancellation import finish_each, finish_shielded
from sandboxes.events import EventSink
from sandboxes.session import BETWEEN_CALLS_POLL_S

# How often expiry is looked at, as a share of the shortest of idle_ms and max_ms, within
# these bounds (and at least every ``BETWEEN_CALLS_POLL_S``, when a sandbox also looks at
# its limits): a sandbox outlives its expiry, or a reload, by at most that much.
SWEEP_SHARE = 0.25
SWEEP_MIN_S = 0.05
SWEEP_MAX_S = 5.0


def is_session_tool(tool: Tool, policy: Policy) -> bool:
    """Whether calls of ``tool`` made in a session run in that session's sandbox (a
    hosted server's tool: in the session's one run of its server)."""
    override = policy.model.tools.get(tool.name)
    if override is not None and override.session is not None:
        return override.session
    return tool.manifest.session


class _Kept(Protocol):
    """What a session keeps open: a session sandbox, or a hosted server's run."""

    def ended(self) -> SessionEnd | None: ...

    async def close(self) -> None: ...


@dataclass(eq=False)
class _Held:
    """One open session sandbox of a tool (or run of a hosted server)."""

    sandbox: _Kept
    backend: str
    opened: float
    used: float
    generation: int
    calls: int = 0
    secrets: str = ""  # ``secrets_digest`` of what it was opened with


Opener = Callable[[], Awaitable[_Kept]]
# What a session holds a sandbox for: ("tool", a plain tool's name, "") or ("server", a
# hosted server's name, what shapes its run). Apart, so that neither can be handed the
# other's sandbox, nor a server's tool a run started with another tool's settings.
Key = tuple[str, str, str]


@dataclass
class SessionNote:
    """What a call learned of its session: whether its sandbox was opened anew after the
    one before it ended unasked (the caller's state is gone)."""

    restarted: bool = False


# The session the calls of this context are made in, and what each call learns of it
# (``runner.call.session_scope.in_session`` sets both).
CURRENT: ContextVar[CallSession | None] = ContextVar("runner_session", default=None)
NOTE: ContextVar[SessionNote | None] = ContextVar("runner_session_note", default=None)


@dataclass(eq=False)
class CallSession:
    """One session: its id, its client (``owner``) and its open sandboxes by tool name."""

    counts: SessionCounts
    audit: AuditLog
    settings: Callable[[], SessionModel]
    clock: Clock
    owner: str | None = None
    id: str = field(default_factory=lambda: "ses_" + secrets.token_hex(12))
    closed: bool = False
    _held: dict[Key, _Held] = field(default_factory=dict)
    _locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    _lost: set[tuple[str, str]] = field(default_factory=set)  # (kind, name): ended unasked
    _sweeper: asyncio.Task[None] | None = None
    _closing: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Register with the runner, which closes the session should it close first."""
        self.counts.sessions.add(self)

    def backend(self, tool: Tool, backend: Sandbox, hosted: HostedWork, generation: int) -> Sandbox:
        """The backend a call of ``tool`` in this session runs on: the session's sandbox
        of the tool, or the session's run of its hosted server (shared by its tools).
        ``generation``: the reload whose policy the call goes by (a sandbox it opens is
        stamped with it, so one opened by a call that began before a reload is closed
        after it, as the ones already open are)."""
        if tool.hosted is not None:
            return _HostedBackend(self, tool.hosted.server, backend, hosted, generation)
        return _SessionBackend(self, ("tool", tool.name, ""), backend, generation)

    async def aclose(self, reason: str = "ended") -> None:
        """End the session: every sandbox of it is killed and released. Safe to call twice,
        and at once from two tasks of its loop (the runner's close and the session's own):
        the second waits for the first, so that no close outlives either. A close going on
        on another loop is not waited for (that loop may be blocked on this one)."""
        self.closed = True
        closing = self._closing
        if closing is not None and closing.get_loop() is not asyncio.get_running_loop():
            return  # going on on another loop (maybe blocked on this close): not ours
        if closing is None:
            closing = self._closing = asyncio.ensure_future(self._close(reason))
            await finish_shielded(closing)
        else:  # the first close's caller gets its outcome
            await finish_shielded(asyncio.wait({closing}))

    async def _close(self, reason: str) -> None:
        sweeper, self._sweeper = self._sweeper, None

        async def sweeper_ended() -> None:
            if sweeper is None:
                return
            loop = sweeper.get_loop()
            if loop is asyncio.get_running_loop():
                sweeper.cancel()
                await asyncio.wait({sweeper})  # a close it began ends, and is told, first
            elif not loop.is_closed():  # that loop may be blocked on this very close
                loop.call_soon_threadsafe(sweeper.cancel)

        async def drop_held() -> None:
            await finish_each(functools.partial(self._drop, name, reason) for name in list(self._held))

        try:
            await finish_each((sweeper_ended, drop_held))
        finally:
            self.counts.sessions.discard(self)  # a runner's close on this loop waits till here

    async def take(
        self,
        key: Key,
        backend: Sandbox,
        open_: Opener,
        note: SessionNote | None,
        generation: int,
        secrets: str = "",
    ) -> tuple[_Held, asyncio.Lock]:
        """The tool's sandbox in this session, opened if need be, with its lock held (the
        caller releases it when its call is over).

        Raises:
            SandboxUnavailable: the session has ended, the backend keeps no sessions, a
                bound is reached, or the sandbox could not be opened.
        """
        lock = self._locks.setdefault(key, asyncio.Lock())
        await lock.acquire()
        try:
            held = self._held.get(key)
            # Opened with other secrets' values: a later call's scrub knows only its own.
            why = held and (self._ends(held) or ("secrets" if held.secrets != secrets else None))
            if held is not None and why:
                await self._drop(key, why)
                held = None
            if held is None:
                held = await self._open(key, backend, open_, generation)
                held.secrets = secrets
                if note is not None and key[:2] in self._lost:
                    note.restarted = True
                self._lost.discard(key[:2])
        except BaseException:
            lock.release()
            raise
        return held, lock

    async def _open(self, key: Key, backend: Sandbox, open_: Opener, generation: int) -> _Held:
        if self.closed:
            raise SandboxUnavailable("the session has ended")
        self.counts.reserve(self.owner, self.settings())
        try:
            sandbox = await open_()
        except BaseException:
            self.counts.release(self.owner)
            raise
        if self.closed:  # closed while it opened: nothing would ever close this sandbox
            try:
                with contextlib.suppress(WorkspaceNotApplied):
                    await finish_shielded(sandbox.close())
            finally:
                self.counts.release(self.owner)
            raise SandboxUnavailable("the session has ended")
        if self._sweeper is None:  # expiry is watched on the loop of the session's calls
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        now = self.clock.monotonic()
        held = _Held(sandbox, backend.name, now, now, generation)
        self._held[key] = held
        restarted = key[:2] in self._lost
        self.audit.emit(
            "session.opened", sessionId=self.id, toolName=key[1], sandbox=backend.name, restarted=restarted
        )
        return held

    async def ended_call(self, key: Key, held: _Held) -> None:
        """After a call in ``held``: close it if the call ended it."""
        held.calls += 1
        held.used = self.clock.monotonic()
        why = _end_reason(held)
        if why is not None and self._held.get(key) is held:
            await self._drop(key, why)

    async def _drop(self, key: Key, reason: str) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        if reason != "ended":
            self._lost.add(key[:2])  # a server's next run may have other settings
        not_applied: dict[str, Any] = {}
        try:
            await finish_shielded(held.sandbox.close())
        except WorkspaceNotApplied as exc:  # the session's writes, no one call's: told here alone
            not_applied["workspaceNotApplied"] = exc.message
            self.audit.operator.warn(f"session {self.id} {key[0]} {key[1]}: {exc.message}")
        finally:
            self.counts.release(self.owner)
            duration = round((self.clock.monotonic() - held.opened) * 1000)
            self.audit.emit(
                "session.closed", sessionId=self.id, toolName=key[1], reason=reason, calls=held.calls,
                duration=duration, **not_applied,
            )  # fmt: skip

    def _ends(self, held: _Held) -> str | None:
        """Why ``held`` is to be closed now (``session.closed``'s reason); None if not."""
        why = self._expired(held) or _end_reason(held)
        if why is None and held.generation != self.counts.generation:
            why = "reloaded"  # even if no call of the tool comes: it holds what was revoked
        return why

    def _expired(self, held: _Held) -> str | None:
        settings, now = self.settings(), self.clock.monotonic()
        if now - held.opened >= settings.max_ms / 1000:
            return "max_ms"
        if now - held.used >= settings.idle_ms / 1000:
            return "idle"
        return None

    async def _sweep(self) -> None:
        """Close the sandboxes that expired, ended by themselves, passed a limit or were
        opened before a reload, while no call came (a call finds them too)."""
        while True:
            settings = self.settings()
            every = min(settings.idle_ms, settings.max_ms) / 1000 * SWEEP_SHARE
            await asyncio.sleep(max(SWEEP_MIN_S, min(SWEEP_MAX_S, BETWEEN_CALLS_POLL_S, every)))
            for key, held in list(self._held.items()):
                lock = self._locks.get(key)
                if lock is None or lock.locked():  # a call's: it looks at the sandbox itself
                    continue
                try:
                    why = self._ends(held)
                except Exception as exc:  # its limits unread: closed, not left unwatched
                    self.audit.operator.fault(exc, sessionId=self.id, toolName=key[1])
                    why = "fault"
                if why is None:
                    continue
                try:
                    async with lock:
                        if self._held.get(key) is held:
                            await self._drop(key, why)
                except Exception as exc:  # a fault of the runner: told, and the sweep goes on
                    self.audit.operator.fault(exc, sessionId=self.id, toolName=key[1])


def _end_reason(held: _Held) -> str | None:
    """Why ``held`` ended unasked, as ``session.closed`` says it; None while it serves."""
    ended = held.sandbox.ended()
    if ended is None:
        return None
    if ended is SessionEnd.DIED:
        return "server_died" if isinstance(held.sandbox, HostedServer) else "died"
    return "limit"


class _SessionBackend:
    """A call's backend in a session: its "prepared sandbox" is the session's own."""

    def __init__(self, session: CallSession, key: Key, backend: Sandbox, generation: int) -> None:
        self.name = backend.name
        self._session = session
        self._key = key
        self._backend = backend
        self._generation = generation

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        backend = self._backend

        async def open_() -> _Kept:
            if not isinstance(backend, HoldsSessions):
                raise SandboxUnavailable(f"the {backend.name} backend cannot keep a sandbox for a session")
            return await backend.open_session(spec, limits)

        note, digest = NOTE.get(), secrets_digest(spec)
        held, lock = await self._session.take(self._key, backend, open_, note, self._generation, digest)
        return _SessionRun(self._session, self._key, held, lock, limits)


class _HostedBackend:
    """A call's backend in a session, for a hosted server's tool: its "prepared sandbox"
    is the session's run of the server."""

    def __init__(
        self, session: CallSession, server: str, backend: Sandbox, hosted: HostedWork, generation: int
    ) -> None:
        self.name = backend.name
        self._session = session
        self._server = server
        self._backend = backend
        self._hosted = hosted
        self._generation = generation

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        backend, held_dialogue = self._backend, self._hosted.held
        max_ms = self._session.settings().max_ms

        async def open_() -> _Kept:
            return await HostedServer.open(backend, spec, limits, held_dialogue(), max_ms)

        key = ("server", self._server, run_settings(backend, spec, limits))
        held, lock = await self._session.take(key, backend, open_, NOTE.get(), self._generation)
        return _HostedRun(_SessionRun(self._session, key, held, lock, limits))


class _HostedRun:
    """One call of a hosted server's tool in the session's run of the server."""

    def __init__(self, run: _SessionRun) -> None:
        self._run = run

    async def run(self, payload: bytes) -> SandboxOutcome:
        raise SandboxUnavailable("a hosted server is spoken with, not fed a payload")

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        server = self._run.held.sandbox
        assert isinstance(server, HostedServer)
        limits = self._run.limits
        return await server.call(cast(HostedDialogue, dialogue), limits.timeout_ms, limits.max_output_bytes)

    async def close(self) -> None:
        await self._run.close()


class _SessionRun:
    """One attempt in a session sandbox; ``close`` hands the sandbox back (or, if the call
    ended it, closes it)."""

    def __init__(
        self, session: CallSession, key: Key, held: _Held, lock: asyncio.Lock, limits: Limits
    ) -> None:
        self._session = session
        self._key = key
        self.held = held
        self._lock: asyncio.Lock | None = lock
        self.limits = limits
        self._events: EventSink | None = None

    def stream_events(self, sink: EventSink) -> None:
        """The coming ``run``'s event lines to ``sink`` (``StreamsEvents``)."""
        self._events = sink

    async def run(self, payload: bytes) -> SandboxOutcome:
        sandbox = cast(SessionSandbox, self.held.sandbox)  # a plain tool's: ``_SessionBackend``
        return await sandbox.run(payload, self.limits.timeout_ms, self._events)

    async def close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            await self._session.ended_call(self._key, self.held)
        finally:
            lock.release()
