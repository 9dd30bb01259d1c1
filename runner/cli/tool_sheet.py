"""``runner show TOOL``: everything about one tool, as the runner will actually run it.

The limits are the resolved ones (``resolve_plan`` with no call options: policy ``tools``
override, manifest, policy defaults, built-ins, capped by the ceilings), and which roles
may call it is asked of the policy engine itself, role by role, so the sheet can never
disagree with a call.
"""

from __future__ import annotations

from typing import Any

from runner.api import Runner
from runner.call.plan import describe, resolve_plan
from runner.call.policy import Policy
from runner.call.requests import CallOptions
from runner.config.egress import NetworkAllow
from runner.tools.manifest import Tool


class UnknownTool(LookupError):
    """No registered tool has that name; ``message`` says so (and why, when it was left out)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def tool_sheet(runner: Runner, name: str) -> dict[str, Any]:
    """The sheet of tool ``name``: discovery's view plus how it runs and who may call it.

    Raises:
        UnknownTool: no registered tool has that name.
    """
    tool = runner.registry.get(name)
    if tool is None:
        if runner.registry.left_out(name):
            raise UnknownTool(
                f"tool {name} is not registered: its manifest is invalid (runner validate says why)"
            )
        raise UnknownTool(f"no tool named {name} is registered (runner list shows the tools)")
    policy = runner.policy
    manifest = tool.manifest
    plan = resolve_plan(tool, policy, CallOptions())
    return {
        **describe(tool, policy),
        "command": manifest.command,
        "outputSchema": manifest.output_schema,
        "directory": str(tool.directory),
        "runsIn": {"sandbox": plan.sandbox, "image": manifest.image, "runtime": plan.runtime},
        "calls": {
            "retries": plan.retries,
            "retryDelayMs": plan.retry_delay_ms,
            "deadlineMs": plan.deadline_ms,
        },
        "asks": {
            "network": _network(manifest.network),
            "workspace": manifest.workspace,
            "secrets": manifest.secrets,
            "secretsGranted": policy.granted_secrets(tool),  # names only, never a value
        },
        "defaultRole": policy.model.default_role,
        "roles": _roles(tool, policy),
        "approval": _approval(tool, policy),
    }


def _network(network: bool | NetworkAllow) -> bool | dict[str, list[str]]:
    """``true``/``false``, or the allow-list as written (``{"allow": [...]}``)."""
    if isinstance(network, bool):
        return network
    return {"allow": list(network.allow)}


def _approval(tool: Tool, policy: Policy) -> dict[str, Any] | None:
    """Which of the roles that may call ``tool`` wait for a person's yes first, and how long."""
    roles = policy.approving_roles(tool)
    approval = policy.model.approval
    if not roles or approval is None:
        return None
    return {"roles": roles, "timeoutMs": approval.timeout_ms}


def _roles(tool: Tool, policy: Policy) -> dict[str, dict[str, Any]]:
    """Each role of the policy: may it call ``tool``, and which rule or reason decided."""
    verdicts: dict[str, dict[str, Any]] = {}
    for role in sorted(policy.model.roles):
        decision = policy.decide(tool, role)
        verdicts[role] = {"allowed": decision.allowed, "reason": decision.reason, "rule": decision.rule}
    return verdicts
