"""Fork mode: a backend that keeps a template per tool, started and imported once, and
forks each call from it (the subprocess backend's ``fork_template``)."""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

from sandboxes.base import LaunchSpec, Limits, WarmSandbox


class ForkTemplate(Protocol):
    """One tool's template. Blocking: made, asked and discarded off the event loop."""

    def call(self, limits: Limits) -> WarmSandbox:
        """A sandbox for one call under ``limits`` (the template's, but the timeout); its
        process is forked when it runs. Cheap: nothing exists before ``run``.

        Raises:
            SandboxUnavailable: the template is closed.
        """
        ...

    def ended(self) -> str | None:
        """None while calls can be forked from it; else, for the operator, why not."""
        ...

    def retire(self) -> None:
        """No more calls: discard it once the calls running from it have ended."""
        ...

    def discard(self) -> None:
        """Kill the template and every call still running from it."""
        ...


@runtime_checkable
class Forks(Protocol):
    """A backend that can run a tool's calls forked from a template of it."""

    def fork_template(self, spec: LaunchSpec, limits: Limits, stop: threading.Event) -> ForkTemplate:
        """Start and freeze the template of ``spec``'s tool (blocking, seconds at most;
        given up at once, what was started killed, when ``stop`` is set).

        Raises:
            SandboxUnavailable: the machine or the tool cannot run in fork mode (the
                message says why), the template was refused, or ``stop`` was set.
        """
        ...
