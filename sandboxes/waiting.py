"""What a warm sandbox tells its pool while it waits for its call."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Waits(Protocol):
    """A warm sandbox that can tell whether its tool still waits for its call (warm pools):
    one that ended before it (a limit killed it while it waited, it exited), or is burning
    the CPU its call would need, can serve no call; its pool discards it and backs off."""

    def ended(self) -> str | None:
        """None while the tool started ahead still runs (or when that cannot be told at
        once); else, for the operator, how it ended. Never blocks, never raises; only for
        a sandbox no call has taken."""
        ...

    def used_cpu_seconds(self) -> float | None:
        """CPU time its processes have used so far (the tool's start-up included); None
        when it cannot be told. Never blocks, never raises."""
        ...


@runtime_checkable
class WatchedWhileWaiting(Protocol):
    """A warm sandbox whose limits no kernel holds for the tool as a whole (without root
    and without a cgroup, where only per-process rlimits apply): its pool looks."""

    def limit_broken_while_waiting(self) -> str | None:
        """For the operator, the limit its processes together have passed, if any. Never
        raises; only for a sandbox no call has taken."""
        ...
