"""Isolation backends.

A backend gets a launch spec, limits and a payload and returns an outcome. It knows
nothing of registries, policies or the wire format: ``runner`` imports ``sandboxes``,
never the reverse.

Its names load on first use (as in ``sandboxes.subprocess``): the runner's watchdog imports
only the sweeping modules of this package, and starts in milliseconds.
"""

from __future__ import annotations

import importlib

# Not typing.TYPE_CHECKING: importing typing would double the watchdog's start-up
# (it runs without site, so nothing has imported typing before); mypy knows this name.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxes.base import (
        BackendConfigError,
        Check,
        ChecksMachine,
        ChecksTools,
        Closable,
        Converses,
        Dialogue,
        EgressEndpoint,
        ImageProbe,
        LaunchSpec,
        Limits,
        Opening,
        OpeningFailed,
        OpeningPipe,
        Pipe,
        PreparedSandbox,
        PreStarts,
        Primes,
        ProbesImages,
        Sandbox,
        SandboxOutcome,
        SandboxUnavailable,
        StartsEarly,
        StopReason,
        ToolRequirements,
        WarmSandbox,
        WorkspaceNotApplied,
    )
    from sandboxes.forking import Forks, ForkTemplate
    from sandboxes.session import HoldsSessions, SessionEnd, SessionSandbox
    from sandboxes.waiting import Waits, WatchedWhileWaiting

__all__ = [
    "BackendConfigError",
    "Check",
    "ChecksMachine",
    "ChecksTools",
    "Closable",
    "Converses",
    "Dialogue",
    "EgressEndpoint",
    "ForkTemplate",
    "Forks",
    "HoldsSessions",
    "ImageProbe",
    "LaunchSpec",
    "Limits",
    "Opening",
    "OpeningFailed",
    "OpeningPipe",
    "Pipe",
    "PreStarts",
    "PreparedSandbox",
    "Primes",
    "ProbesImages",
    "Sandbox",
    "SandboxOutcome",
    "SandboxUnavailable",
    "SessionEnd",
    "SessionSandbox",
    "StartsEarly",
    "StopReason",
    "ToolRequirements",
    "Waits",
    "WarmSandbox",
    "WatchedWhileWaiting",
    "WorkspaceNotApplied",
]
_SESSION_NAMES = frozenset({"HoldsSessions", "SessionEnd", "SessionSandbox"})
_FORK_NAMES = frozenset({"ForkTemplate", "Forks"})
_WAITING_NAMES = frozenset({"Waits", "WatchedWhileWaiting"})


def __getattr__(name: str) -> object:
    if name in _SESSION_NAMES:
        return getattr(importlib.import_module("sandboxes.session"), name)
    if name in _FORK_NAMES:
        return getattr(importlib.import_module("sandboxes.forking"), name)
    if name in _WAITING_NAMES:
        return getattr(importlib.import_module("sandboxes.waiting"), name)
    if name in __all__:
        return getattr(importlib.import_module("sandboxes.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
