"""The session sandboxes open in a runner, counted against ``session.max_total`` and
``session.max_per_token``, and the sessions the runner closes when it closes."""

from __future__ import annotations

import threading
from typing import Protocol

from runner.call.policy import SessionModel
from sandboxes import SandboxUnavailable


class OpenSession(Protocol):
    async def aclose(self, reason: str = "ended") -> None: ...


class SessionCounts:
    """The session sandboxes open in a runner: in all, and per client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0
        self._by_owner: dict[str, int] = {}
        self.sessions: set[OpenSession] = set()
        # Moved on by each reload of the policy and tools: a session sandbox opened before
        # holds the old settings (limits, grants, secrets, code) and is opened anew.
        self.generation = 0

    def reserve(self, owner: str | None, settings: SessionModel) -> None:
        """Count one more open sandbox of ``owner``.

        Raises:
            SandboxUnavailable: ``session.max_total`` or ``session.max_per_token`` is reached.
        """
        with self._lock:
            if self._total >= settings.max_total:
                raise SandboxUnavailable(
                    f"session.max_total reached: {self._total} session sandboxes are open"
                )
            held = self._by_owner.get(owner, 0) if owner is not None else 0
            if owner is not None and held >= settings.max_per_token:
                raise SandboxUnavailable(f"session.max_per_token reached: this client holds {held}")
            self._total += 1
            if owner is not None:
                self._by_owner[owner] = held + 1

    def release(self, owner: str | None) -> None:
        with self._lock:
            self._total -= 1
            if owner is not None:
                left = self._by_owner.pop(owner, 1) - 1
                if left > 0:
                    self._by_owner[owner] = left

    def open_count(self) -> int:
        with self._lock:
            return self._total
