"""Sandboxes that outlive one call: a session's (a conversation with a stateful tool).

A session sandbox is started once and serves its session's calls one after the other:
each call runs the tool's command again inside it, so what a call leaves in its
filesystem (``/tmp``, home, staged workspace writes), its network namespace and its
background processes is there for the next call. Its limits (memory, pids, CPU time,
disk) hold for the whole session. A call that does not end by its own exit (a timeout,
output past the cap, a limit broken) ends the session: its sandbox is killed whole, so
nothing a timed-out call started keeps running in it.
"""

from __future__ import annotations

import enum
import time
from typing import Protocol, runtime_checkable

from sandboxes.base import LaunchSpec, Limits, SandboxOutcome
from sandboxes.events import EventSink

# Between calls nothing else polls a session sandbox's limits: ``ended`` looks at them
# at most this often (the session's sweeper asks it at least this often), so a process a
# call left behind passes a limit by at most that long.
BETWEEN_CALLS_POLL_S = 0.5


class BetweenCalls:
    """When ``ended`` looks at the limits again: at most every ``BETWEEN_CALLS_POLL_S``."""

    def __init__(self) -> None:
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + BETWEEN_CALLS_POLL_S
        return True


class SessionEnd(enum.StrEnum):
    """Why a session sandbox serves no more calls (besides its ``close``)."""

    LIMIT = "limit"  # a call broke a limit, timed out or overflowed: the sandbox was killed
    DIED = "died"  # the sandbox ended by itself (its processes were killed from outside)


class SessionSandbox(Protocol):
    """A sandbox kept between the calls of one session."""

    async def run(self, payload: bytes, timeout_ms: int, events: EventSink | None = None) -> SandboxOutcome:
        """Run the tool's command once more inside the sandbox, ``payload`` on stdin, under
        ``timeout_ms`` and the session's limits, its event lines to ``events``. One call at
        a time.

        Raises:
            SandboxUnavailable: the sandbox has ended (``ended`` says why) or is busy.
        """
        ...

    def ended(self) -> SessionEnd | None:
        """None while the sandbox can serve a call; else why it cannot. Never blocks.
        Between calls, it also looks at the limits of the sandbox as a whole (at most
        every ``BETWEEN_CALLS_POLL_S``): one passed ends it (``LIMIT``)."""
        ...

    async def close(self) -> None:
        """Kill everything in the sandbox and release it. Safe to call twice."""
        ...


@runtime_checkable
class HoldsSessions(Protocol):
    """A backend that can keep a sandbox between calls (sessions)."""

    async def open_session(self, spec: LaunchSpec, limits: Limits) -> SessionSandbox:
        """Start a session sandbox for ``spec`` (its tool is run by each ``run``).

        Raises:
            SandboxUnavailable: this machine cannot give the isolation required, or
                ``spec`` needs what only one call can give (an egress endpoint).
        """
        ...
