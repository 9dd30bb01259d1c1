"""Resolving what one call may use: limits, retries, deadline and sandbox.

Each value comes from the first of: call options, policy ``tools`` override, manifest,
policy ``defaults``, built-in default. Every limit is then capped by the policy's
``limits`` ceilings, which nothing can raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runner.manifest import Tool
from runner.models import CallOptions
from runner.policy import Policy
from sandboxes import Limits

BUILTIN = {
    "timeout_ms": 5000,
    "retries": 3,
    "retry_delay_ms": 1000,
    "deadline_ms": 5000,
    "memory_mb": 256,
    "cpu_seconds": 10,
    "max_pids": 64,
    "max_output_bytes": 1024 * 1024,
    "disk_mb": 64,
}
CEILINGED = ("timeout_ms", "memory_mb", "cpu_seconds", "max_pids", "max_output_bytes", "disk_mb")


@dataclass(frozen=True)
class CallPlan:
    """Everything the executor needs to know about how to run one call."""

    limits: Limits
    retries: int
    retry_delay_ms: int
    deadline_ms: int
    format: Literal["json", "raw"]
    sandbox: str
    runtime: str | None


def _first(*values: int | None) -> int:
    for value in values:
        if value is not None:
            return value
    raise AssertionError("unreachable: the built-in default is always last")


def resolve_plan(tool: Tool, policy: Policy, options: CallOptions) -> CallPlan:
    model = policy.model
    override = model.tools.get(tool.name)
    from_call = {
        "timeout_ms": options.timeout,
        "retries": options.retries,
        "retry_delay_ms": options.retry_delay,
        "deadline_ms": options.deadline,
    }
    layers = [
        from_call,
        override.model_dump() if override else {},
        tool.manifest.limits.model_dump(),
        model.defaults.model_dump(),
        BUILTIN,
    ]
    values = {key: _first(*(layer.get(key) for layer in layers)) for key in BUILTIN}
    ceilings = model.limits.model_dump()
    for key in CEILINGED:
        if ceilings.get(key) is not None:
            values[key] = min(values[key], ceilings[key])
    limits = Limits(
        timeout_ms=values["timeout_ms"],
        memory_mb=values["memory_mb"],
        cpu_seconds=values["cpu_seconds"],
        max_pids=values["max_pids"],
        max_output_bytes=values["max_output_bytes"],
        disk_mb=values["disk_mb"],
        network=tool.manifest.network and model.limits.network,
    )
    sandbox = (override.sandbox if override else None) or tool.manifest.sandbox
    runtime = override.runtime if override else None  # else the backend's own default
    return CallPlan(
        limits=limits,
        retries=values["retries"],
        retry_delay_ms=values["retry_delay_ms"],
        deadline_ms=values["deadline_ms"],
        format=options.format,
        sandbox=sandbox,
        runtime=runtime,
    )
