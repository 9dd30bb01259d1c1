"""What the call path tells an observer of a call: the hooks ``runner.telemetry`` feeds its
metrics and spans from. The core calls them; it never imports the observer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from sandboxes import Sandbox

CANCELLED = "CANCELLED"  # the code ``finished`` is told for a call cancelled before its answer


class CallHooks(Protocol):
    """One call's hooks. ``trace_id`` is its W3C trace id (32 hex digits)."""

    trace_id: str

    def timed(self, sandbox: Sandbox) -> Sandbox:
        """``sandbox``, its ``prepare`` timed."""
        ...

    def discovering(self) -> None:
        """The request is a discovery, not a call of a tool."""
        ...

    def attempt_started(self, tool: str, backend: str) -> None: ...

    def attempt_ended(self, fields: Mapping[str, Any]) -> None:
        """``fields``: the attempt's ``call.attempt`` audit event."""
        ...

    def finished(
        self, tool_name: str | None, role: str | None, code: str | None, attempts: int, seconds: float
    ) -> None:
        """The call's answer (``code`` None: success; ``CANCELLED``)."""
        ...


class NoHooks:
    """Nobody observing: every hook returns at once."""

    trace_id = "0" * 32

    def timed(self, sandbox: Sandbox) -> Sandbox:
        return sandbox

    def discovering(self) -> None:
        return None

    def attempt_started(self, tool: str, backend: str) -> None:
        return None

    def attempt_ended(self, fields: Mapping[str, Any]) -> None:
        return None

    def finished(
        self, tool_name: str | None, role: str | None, code: str | None, attempts: int, seconds: float
    ) -> None:
        return None


NO_HOOKS: CallHooks = NoHooks()
