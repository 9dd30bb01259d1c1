"""Which tools a role may call, and how discovery describes them."""

from __future__ import annotations

from typing import Any

from runner.call.guard import caller
from runner.call.plan import describe
from runner.call.policy import Policy
from runner.errors import CallError, ErrorCode
from runner.tools.manifest import Tool
from runner.tools.registry import Registry, matches_filter


def callable_tools(registry: Registry, policy: Policy, role: str | None) -> list[Tool]:
    """The tools of ``registry`` that ``role`` (default: the policy's) may call, by name.

    Raises:
        CallError: PERMISSION_DENIED when the role is unknown or missing.
    """
    resolved = policy.resolve_role(role)
    if resolved is None or resolved not in policy.model.roles:
        reason = "no_role" if resolved is None else "unknown_role"
        raise CallError(
            ErrorCode.PERMISSION_DENIED,
            f"{caller(resolved)} may not discover tools: {reason}",
            {"reason": reason, "role": resolved},
        )
    return [tool for tool in registry if policy.decide(tool, resolved).allowed]


def discovered(
    registry: Registry, policy: Policy, filter_text: str | None, role: str | None
) -> list[dict[str, Any]]:
    """What discovery shows of the tools ``role`` may call whose name, description or
    tags contain ``filter_text``.

    Raises:
        CallError: as ``callable_tools``.
    """
    return [
        describe(tool, policy)
        for tool in callable_tools(registry, policy, role)
        if matches_filter(tool, filter_text)
    ]


def tool_definitions(
    registry: Registry, policy: Policy, format: str, role: str | None, *, strict: bool = False
) -> list[Any]:
    """The tools ``role`` may call as definitions for an agent (``runner.tools.definitions``).

    Raises:
        ValueError: ``format`` is not one the definitions know, or ``strict`` with one that
            has no strict mode.
        CallError: as ``callable_tools``.
    """
    from runner.tools.definitions import definitions  # only exports need them: not on the call path

    return definitions(callable_tools(registry, policy, role), format, strict=strict).tools
