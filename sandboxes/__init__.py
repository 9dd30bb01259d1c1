"""Isolation backends.

A backend gets a launch spec, limits and a payload and returns an outcome. It knows
nothing of registries, policies or the wire format: ``runner`` imports ``sandboxes``,
never the reverse.
"""

from sandboxes.base import (
    BackendConfigError,
    Check,
    ChecksMachine,
    ChecksTools,
    Closable,
    EgressEndpoint,
    LaunchSpec,
    Limits,
    PreparedSandbox,
    Sandbox,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
    ToolRequirements,
)

__all__ = [
    "BackendConfigError",
    "Check",
    "ChecksMachine",
    "ChecksTools",
    "Closable",
    "EgressEndpoint",
    "LaunchSpec",
    "Limits",
    "PreparedSandbox",
    "Sandbox",
    "SandboxOutcome",
    "SandboxUnavailable",
    "StopReason",
    "ToolRequirements",
]
