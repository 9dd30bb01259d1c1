"""Resolving what one call may use: limits, retries, deadline and sandbox.

Each value comes from the first of: call options, policy ``tools`` override, manifest,
policy ``defaults``, built-in default. Every limit is then capped by the policy's
``limits`` ceilings, which nothing can raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from runner.call.policy import Policy
from runner.call.requests import CallOptions
from runner.config.settings import RESOURCE_FIELDS, CallSettings, first_set
from runner.tools.manifest import Tool
from sandboxes import LaunchSpec, Limits


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


def resolve_plan(tool: Tool, policy: Policy, options: CallOptions) -> CallPlan:
    model = policy.model
    override = model.tools.get(tool.name)
    from_call = CallSettings(
        timeout_ms=options.timeout,
        retries=options.retries,
        retry_delay_ms=options.retry_delay,
        deadline_ms=options.deadline,
    )
    layers = [from_call, override or CallSettings(), tool.manifest.limits, model.defaults]
    values = first_set(*layers)
    for name in RESOURCE_FIELDS:
        ceiling = getattr(model.limits, name)
        if ceiling is not None:
            values[name] = min(values[name], ceiling)
    limits = Limits(
        **{name: values[name] for name in RESOURCE_FIELDS},
        # An allow-list is not a network of the tool's own: it gets the egress proxy.
        network=tool.manifest.network is True and model.limits.network,
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


def launch_spec(tool: Tool, request_id: str, policy: Policy, runtime: str | None) -> LaunchSpec:
    """What a call of ``tool`` runs and may see, secrets and egress aside (the call's own)."""
    manifest = tool.manifest
    env = {**manifest.env, "TOOL_NAME": tool.name, "REQUEST_ID": request_id}
    return LaunchSpec(
        tool_name=tool.name,
        request_id=request_id,
        command=tuple(manifest.command),
        tool_dir=tool.directory,
        env=env,
        workspace=policy.workspace if manifest.workspace != "none" else None,
        workspace_mode=manifest.workspace,
        image=manifest.image,
        runtime=runtime,
    )


def describe(tool: Tool, policy: Policy) -> dict[str, Any]:
    """``tool`` as a discovery lists it, with the limits its calls get under ``policy``."""
    manifest = tool.manifest
    limits = resolve_plan(tool, policy, CallOptions()).limits
    return {
        "name": manifest.name,
        "description": manifest.description,
        "paramsSchema": manifest.parameters,
        "metadata": {
            "tags": manifest.tags,
            "version": manifest.version,
            "sandbox": manifest.sandbox,
            "limits": {
                "timeoutMs": limits.timeout_ms,
                "memoryMb": limits.memory_mb,
                "cpuSeconds": limits.cpu_seconds,
                "maxPids": limits.max_pids,
                "maxOutputBytes": limits.max_output_bytes,
                "diskMb": limits.disk_mb,
                "network": limits.network,
            },
        },
    }
