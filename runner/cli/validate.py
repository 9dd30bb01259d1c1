"""``runner validate``: every problem of the tools and the policy, before any call meets it.

Beyond what loading reports (bad manifests, left out): a command that will not start in
its sandbox, a missing or unreadable script, a docker image that is not there, policy
rules and ``tools:`` keys that match no tool, and network and secret grants that do not
fit the manifests. Each problem names the tool or the file it concerns, a severity and a
one-line reason. An *error* means calls of that tool will fail (or it is left out); a
*warning* means the configuration says something that has no effect.

Secret values are never read here, let alone printed: only names and where they come from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Literal

from runner.call.plan import resolve_plan
from runner.call.policy import Policy, matching_rule
from runner.call.requests import CallOptions
from runner.cli.checks import host_command_problem, image_probe, script_problem
from runner.config.egress import NetworkAllow
from runner.secrets.sources import read_secrets
from runner.tools.manifest import Tool
from runner.tools.registry import Registry
from runner.tools.scaffold import PLACEHOLDER
from sandboxes import ImageProbe

Severity = Literal["error", "warning"]
# Which check found it: "manifest" (loading left the tool out), "command", "image",
# "network", "secrets", "policy", "description".
Check = str
DOCKER, SUBPROCESS = "docker", "subprocess"


@dataclass(frozen=True)
class Finding:
    """One problem: what it concerns (a tool's name, or None for a whole file), where."""

    severity: Severity
    check: Check
    tool: str | None
    file: str
    reason: str

    def wire(self) -> dict[str, str | None]:
        return asdict(self)


@dataclass(frozen=True)
class Report:
    """Every finding, and the tools that loaded."""

    findings: tuple[Finding, ...]
    tools: tuple[Tool, ...]

    @property
    def errors(self) -> int:
        return sum(1 for finding in self.findings if finding.severity == "error")

    @property
    def warnings(self) -> int:
        return len(self.findings) - self.errors

    def failed(self, tool: Tool) -> bool:
        return any(f.severity == "error" and f.tool == tool.name for f in self.findings)


def validate(registry: Registry, policy: Policy) -> Report:
    """Check the loaded tools and the policy together. Asks the Docker daemon only when a
    docker tool is there; a daemon that cannot be reached is one error per such tool."""
    findings = [
        Finding("error", "manifest", problem.folder, str(problem.path), problem.reason)
        for problem in registry.problems
    ]
    tools = sorted(registry, key=lambda tool: tool.name)
    sandboxes = {tool.name: _sandbox_of(tool, policy) for tool in tools}
    if any(name == DOCKER for name in sandboxes.values()):
        with image_probe() as probe:
            for tool in tools:
                findings += _tool_findings(tool, policy, sandboxes[tool.name], probe)
    else:
        for tool in tools:
            findings += _tool_findings(tool, policy, sandboxes[tool.name], None)
    findings += _policy_findings(tools, policy)
    return Report(tuple(findings), tuple(tools))


def _sandbox_of(tool: Tool, policy: Policy) -> str:
    """The backend a call of ``tool`` would use (the policy's ``tools.NAME.sandbox`` wins)."""
    return resolve_plan(tool, policy, CallOptions()).sandbox


def _tool_findings(tool: Tool, policy: Policy, sandbox: str, probe: ImageProbe | str | None) -> list[Finding]:
    manifest_file = str(tool.directory / "tool.yaml")
    reasons = list(_command_reasons(tool, sandbox, probe))
    if PLACEHOLDER in (tool.manifest.description or ""):
        what = "the description is still runner new's placeholder: say what the tool does"
        reasons.append(("warning", "description", what))
    reasons += [(severity, "network", reason) for severity, reason in _network_reasons(tool, policy)]
    reasons += [(severity, "secrets", reason) for severity, reason in _secret_reasons(tool, policy)]
    return [Finding(severity, check, tool.name, manifest_file, reason) for severity, check, reason in reasons]


def _command_reasons(
    tool: Tool, sandbox: str, probe: ImageProbe | str | None
) -> Iterator[tuple[Severity, Check, str]]:
    """The first thing that keeps the command from starting: image, program, script.
    Other backends (plugins) show the tool who knows what: only the script is checked."""
    from sandboxes import SandboxUnavailable

    command, env, image = tool.manifest.command, tool.manifest.env, tool.manifest.image
    problem = None
    if sandbox == SUBPROCESS:
        problem = host_command_problem(command, env, tool.directory)
    elif sandbox == DOCKER and image is None:  # moved to docker by the policy's tools.NAME.sandbox
        yield "error", "image", "the policy runs it in docker, but its manifest names no image"
        return
    elif sandbox == DOCKER and image is not None:
        if not isinstance(probe, ImageProbe):
            yield "error", "image", f"cannot check image {image}: {probe}"
            return
        try:
            image_problem = probe.image_problem(image)
            if image_problem is not None:
                yield "error", "image", image_problem
                return
            problem = probe.command_problem(image, command, env)
        except SandboxUnavailable as exc:
            yield "error", "image", f"cannot check image {image}: {exc}"
            return
    problem = problem or script_problem(command, tool.directory)
    if problem is not None:
        yield "error", "command", problem


# -- network and secrets ------------------------------------------------------------------


def _network_reasons(tool: Tool, policy: Policy) -> Iterator[tuple[Severity, str]]:
    asked = tool.manifest.network
    override = policy.model.tools.get(tool.name)
    granted = override.network.allow if override is not None and override.network is not None else []
    allow = asked.allow if isinstance(asked, NetworkAllow) else []
    if asked is not False and not policy.model.limits.network:
        yield "error", "asks for a network, but the policy's limits.network is false: every call is refused"
    elif allow:
        if not granted:
            yield "error", f"asks for network destinations but tools.{tool.name}.network.allow grants none"
        else:
            for destination in allow:
                if destination not in granted:
                    yield "warning", f"network destination {destination} is not granted by the policy"
    if granted and not allow:
        yield "warning", "the policy grants network destinations to a tool that asks for none"
    for destination in granted:
        if allow and destination not in allow:
            yield "warning", f"the policy grants {destination}, which the manifest does not ask for"


def _secret_reasons(tool: Tool, policy: Policy) -> Iterator[tuple[Severity, str]]:
    granted = policy.granted_secrets(tool)
    for name in tool.manifest.secrets:
        if name not in granted:
            yield "error", f"secret {name} is not granted by the policy (tools.{tool.name}.secrets)"
    override = policy.model.tools.get(tool.name)
    for name in override.secrets if override is not None else []:
        if name not in tool.manifest.secrets:
            yield "warning", f"the policy grants secret {name}, which the manifest does not list"
    # Read to know whether a value is there (and would be accepted); never printed.
    found = read_secrets(granted, policy.model.secrets, policy.base_dir)
    for gone in found.missing:
        yield "warning", f"secret {gone.name}: {gone.for_operator}"


# -- the policy's own rules ---------------------------------------------------------------


def _policy_findings(tools: list[Tool], policy: Policy) -> list[Finding]:
    source = policy.source
    model = policy.model
    findings: list[Finding] = []

    def unmatched(where: str, patterns: Iterable[str]) -> None:
        for pattern in patterns:
            if not any(matching_rule([pattern], tool) for tool in tools):
                reason = f"{where}: rule {pattern!r} matches no tool"
                findings.append(Finding("warning", "policy", None, source, reason))

    unmatched("whitelist", model.whitelist)
    unmatched("disabled", model.disabled)
    unmatched("approval.tools", model.approval.tools if model.approval is not None else [])
    for role, rules in model.roles.items():
        unmatched(f"roles.{role}.allow", rules.allow)
        unmatched(f"roles.{role}.deny", rules.deny)
    names = {tool.name for tool in tools}
    for name in model.tools:
        if name not in names:
            reason = f"tools.{name}: no tool of that name is loaded"
            findings.append(Finding("warning", "policy", name, source, reason))
    findings += _unused_secrets(tools, policy)
    return findings


def _unused_secrets(tools: list[Tool], policy: Policy) -> list[Finding]:
    granted = {name for override in policy.model.tools.values() for name in override.secrets}
    return [
        Finding("warning", "secrets", None, policy.source, f"secrets.{name}: granted to no tool")
        for name in policy.model.secrets
        if name not in granted
    ]


def human_lines(report: Report, echo: Callable[[str], None], policy: Policy) -> None:
    """The report for a person: problems first, then the tools that are fine (and the roles
    whose calls of each wait for a person's approval)."""
    for finding in report.findings:
        if finding.check == "manifest":
            echo(f"invalid: {finding.file}: {finding.reason}")
        else:
            subject = finding.tool or finding.file
            echo(f"{finding.severity}: {subject}: {finding.reason}")
    for tool in report.tools:
        if not report.failed(tool):
            held = policy.approving_roles(tool)
            approval = f", approval for {', '.join(held)}" if held else ""
            echo(f"ok: {tool.name} ({tool.directory}){approval}")
    echo(f"{len(report.tools)} tools, {report.errors} errors, {report.warnings} warnings")


def wire(report: Report, policy: Policy) -> dict[str, object]:
    """The report as one JSON document (``runner validate --json``); ``approval`` lists the
    roles whose calls of a tool wait for a person's approval."""
    return {
        "ok": report.errors == 0,
        "tools": [
            {
                "name": tool.name,
                "directory": str(tool.directory),
                "ok": not report.failed(tool),
                "approval": policy.approving_roles(tool),
            }
            for tool in report.tools
        ],
        "problems": [finding.wire() for finding in report.findings],
        "errors": report.errors,
        "warnings": report.warnings,
    }
