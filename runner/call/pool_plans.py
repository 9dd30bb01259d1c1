"""Which tools get a warm pool, and what each pool starts: the policy's ``pool`` settings
against what a tool needs for its call alone (secrets, network, workspace) and what its
backend can do ahead (``PreStarts``), or, in fork mode, keep a template of (``Forks``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.call.plan import resolve_plan
from runner.call.policy import Policy, matching_rule
from sandboxes import Forks, LaunchSpec, Limits, PreStarts, Sandbox

if TYPE_CHECKING:
    from runner.call.requests import CallOptions
    from runner.tools.manifest import Tool
    from runner.tools.registry import Registry


@dataclass(frozen=True)
class PoolPlan:
    """One tool's pool: how many, from which backend, started with what."""

    size: int
    backend: PreStarts
    spec: LaunchSpec
    limits: Limits
    hosted: bool = False  # an MCP server's: initialized ahead when the backend ``Primes``
    # Fork mode: one template (``Forks``), each call forked from it, not ``size`` sandboxes.
    fork: bool = False


def not_pooled_because(tool: Tool, policy: Policy) -> str | None:
    """Why ``tool`` runs cold whatever its pool size; None when it can be pooled."""
    manifest = tool.manifest
    if policy.granted_secrets(tool) or manifest.secrets:
        return "its secrets are read for each call"
    if manifest.network is not False:
        return "its network (or egress proxy) is made for each call"
    if manifest.workspace != "none":
        return "its workspace is mounted as it is at call time"
    return None


def pool_plans(
    registry: Registry,
    policy: Policy,
    backend: Callable[[str], Sandbox],
    no_options: CallOptions,
    warn: Callable[[str], None],
) -> dict[str, PoolPlan]:
    """The pools ``policy`` asks for, by tool name; ``warn`` hears of each tool the policy
    names a pool for that cannot have one."""
    model = policy.model
    plans: dict[str, PoolPlan] = {}
    for tool in registry:
        override = model.tools.get(tool.name)
        explicit = override is not None and override.pool is not None
        size = override.pool if override is not None and override.pool is not None else model.pool.size
        if size == 0 or matching_rule(model.whitelist, tool) is None or matching_rule(model.disabled, tool):
            continue  # a tool no call may run needs no warm sandbox
        plan = resolve_plan(tool, policy, no_options)
        why = not_pooled_because(tool, policy)
        chosen = backend(plan.sandbox)
        if why is None and not isinstance(chosen, PreStarts):
            why = f"the {plan.sandbox} backend cannot start sandboxes ahead"
        if why is not None:
            if explicit:
                warn(f"tools.{tool.name}.pool: {tool.name} is not pooled: {why}")
            continue
        assert isinstance(chosen, PreStarts)
        mode = (
            override.pool_mode if override is not None and override.pool_mode is not None else model.pool.mode
        )
        fork = mode == "fork" and tool.hosted is None and isinstance(chosen, Forks)
        if mode == "fork" and not fork:
            what = (
                "a hosted MCP server" if tool.hosted is not None else f"a tool of the {plan.sandbox} backend"
            )
            warn(f"{tool.name} is {what}, which has no fork mode: its pool keeps warm sandboxes")
        spec = _warm_spec(tool, plan.runtime)
        plans[tool.name] = PoolPlan(
            size, chosen, spec, plan.limits, hosted=tool.hosted is not None, fork=fork
        )
    return plans


def _warm_spec(tool: Tool, runtime: str | None) -> LaunchSpec:
    """The launch spec of a sandbox made before its call: no ``REQUEST_ID`` (the
    tool reads ``context.requestId``), no secrets, no egress."""
    manifest = tool.manifest
    return LaunchSpec(
        tool_name=tool.name,
        request_id="",
        command=tuple(manifest.command),
        tool_dir=tool.directory,
        env={**manifest.env, "TOOL_NAME": tool.name},
        image=manifest.image,
        runtime=runtime,
    )
