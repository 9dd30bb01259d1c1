"""Which tools the policy's ``dispatch:`` section covers, and the sandbox of such a call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.call.policy import matching_rule
from runner.config.dispatch import DispatchModel
from runner.tools.manifest import Tool

if TYPE_CHECKING:
    from runner.call.policy import Policy
    from sandboxes import Sandbox


def covers(model: DispatchModel | None, tool: Tool) -> bool:
    """Is ``tool`` dispatched? (``tools`` matched as the policy's rules are.)"""
    return model is not None and matching_rule(model.tools, tool) is not None


def dispatched_sandbox(policy: Policy, tool: Tool, backend: str) -> Sandbox | None:
    """The sandbox of a call of ``tool`` when the policy dispatches it; None when it runs here."""
    model = policy.model.dispatch
    if model is None or not covers(model, tool):
        return None
    from runner.dispatch.sandbox import DispatchedSandbox  # the packing and the cluster: on use

    config: dict[str, Any] = policy.model.sandbox.backends.get(backend, {})
    return DispatchedSandbox(backend, config, model, policy.base_dir)
