"""What a policy must grant before an installed server's tools can be called.

The policy's own ``decide`` says why a tool is refused; the grant that lifts that refusal
is recorded, applied to a copy of the policy, and the tool decided again, until each tool
is allowed or its refusal needs more than an addition (a deny rule, a ``disabled`` entry,
no role). The additions are YAML in the shape of the policy file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from runner.call.policy import Policy, PolicyDecision, PolicyModel, RoleModel, ToolOverrideModel
from runner.config.egress import NetworkAllow
from runner.tools.manifest import ManifestModel, Tool

_ROUNDS = 8  # one per kind of refusal is enough: each grant lifts one for good


@dataclass(frozen=True)
class Grants:
    """What to add to the policy (``additions``, nested as in the file) and what must be
    taken out of it instead (``removals``, in words)."""

    role: str | None
    additions: dict[str, Any] = field(default_factory=dict)
    removals: tuple[str, ...] = ()

    def yaml_lines(self) -> list[str]:
        """The additions as YAML lines (empty when none are needed)."""
        if not self.additions:
            return []
        text = yaml.safe_dump(self.additions, default_flow_style=None, sort_keys=False, allow_unicode=False)
        return text.splitlines()


def needed_grants(
    policy: Policy, server: str, tools: Sequence[Tool], manifest: Mapping[str, Any], role: str | None = None
) -> Grants:
    """The grants that let ``role`` (default: the policy's default role) call ``tools``, the
    server's registered tools, each by its name; with none registered (its tools did not
    load), what a tool ``SERVER_*`` with the server's ``manifest`` needs."""
    role = role or policy.model.default_role
    additions: dict[str, Any] = {}
    removals: list[str] = []
    model = policy.model
    for tool in tools or [_stand_in(server, manifest, policy.base_dir)]:
        # Each tool by its name: SERVER_* would also grant the tools of a server named
        # SERVER_more, installed then or later, and any tool named so.
        pattern = tool.name if tools else f"{server}_*"
        for _ in range(_ROUNDS):
            decision = Policy(model, policy.base_dir, policy.source).decide(tool, role)
            if decision.allowed:
                break
            lifted = _lift(model, tool, decision, pattern, additions)
            if lifted is None:
                removals.append(_removal(tool, decision))
                break
            model = lifted
    return Grants(role, additions, tuple(dict.fromkeys(removals)))


def _lift(
    model: PolicyModel, tool: Tool, decision: PolicyDecision, pattern: str, additions: dict[str, Any]
) -> PolicyModel | None:
    """``model`` with the grant that lifts ``decision`` (recorded in ``additions``), or None
    when no addition can."""
    reason, role = decision.reason, decision.role
    if reason == "not_whitelisted":
        _add(additions, ("whitelist",), [pattern])
        return model.model_copy(update={"whitelist": [*model.whitelist, pattern]})
    if reason == "not_allowed" and role is not None:
        _add(additions, ("roles", role, "allow"), [pattern])
        roles = dict(model.roles)
        entry = roles.get(role, RoleModel())
        roles[role] = entry.model_copy(update={"allow": [*entry.allow, pattern]})
        return model.model_copy(update={"roles": roles})
    if reason == "no_workspace":
        _add(additions, ("workspace",), "./workspace")
        return model.model_copy(update={"workspace": "./workspace"})
    if reason == "network" and decision.rule == "limits.network":
        _add(additions, ("limits", "network"), True)
        return model.model_copy(update={"limits": model.limits.model_copy(update={"network": True})})
    if reason == "network" and isinstance(tool.manifest.network, NetworkAllow):
        allow = list(tool.manifest.network.allow)
        _add(additions, ("tools", tool.name, "network", "allow"), allow)
        return _with_override(model, tool.name, network=NetworkAllow(allow=allow))
    if reason == "secret":
        granted = model.tools[tool.name].secrets if tool.name in model.tools else []
        missing = [name for name in tool.manifest.secrets if name not in granted]
        _add(additions, ("tools", tool.name, "secrets"), missing)
        for name in missing:
            if name not in model.secrets:
                _add(additions, ("secrets", name), {"env": name})
        return _with_override(model, tool.name, secrets=[*granted, *missing])
    return None


def _with_override(model: PolicyModel, name: str, **update: Any) -> PolicyModel:
    tools = dict(model.tools)
    tools[name] = tools.get(name, ToolOverrideModel()).model_copy(update=update)
    return model.model_copy(update={"tools": tools})


def _add(additions: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in the nested ``additions``; lists are merged."""
    *parents, last = path
    here = additions
    for key in parents:
        here = here.setdefault(key, {})
    if isinstance(value, list):
        merged = here.setdefault(last, [])
        merged.extend(item for item in value if item not in merged)
    else:
        here[last] = value


def _removal(tool: Tool, decision: PolicyDecision) -> str:
    if decision.reason == "disabled":
        return f"disabled: {decision.rule!r} switches {tool.name} off"
    if decision.reason == "denied_by_role":
        where = f"roles.{decision.role}"
        return f"{where}: the deny rule {decision.rule!r} (or an inherited one) refuses {tool.name}"
    if decision.reason == "no_role":
        return "the policy has no default_role: each call must name a role that allows them"
    return f"{tool.name}: {decision.reason}"


def _stand_in(server: str, manifest: Mapping[str, Any], directory: Path) -> Tool:
    """A tool as the server's would register: named ``SERVER_...``, tagged ``mcp`` and
    the manifest's tags, asking for what the manifest asks for."""
    asks = {key: manifest[key] for key in ("network", "workspace", "secrets") if key in manifest}
    tags = [*manifest.get("tags", []), "mcp"] if isinstance(manifest.get("tags", []), list) else ["mcp"]
    base = {
        "name": f"{server}_tool",
        "description": "stand-in",
        "command": ["true"],
        "parameters": {"type": "object"},
        "tags": tags,
    }
    try:
        model = ManifestModel.model_validate({**base, **asks})
    except ValidationError:
        model = ManifestModel.model_validate(base)  # the load problems say what is wrong
    return Tool(model, directory)
