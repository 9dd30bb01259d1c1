"""``policies.yaml``: whitelist, roles, defaults and ceilings, and the decision engine.

Deny is the default: a tool is callable only when it is whitelisted, not disabled, and
allowed (and not denied) by the role of the call, inherited rules included. A policy
file that fails to load stops the runner; there is no fallback that allows.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from runner.audit.key import ChainKeySource
from runner.config.approval import ApprovalModel
from runner.config.dispatch import DispatchModel, token_problem
from runner.config.egress import NetworkAllow
from runner.config.settings import CallSettings, ResourceSettings
from runner.config.yaml_files import YamlFileError, load_yaml_file
from runner.errors import ConfigError
from runner.schema.suggest import pydantic_problem
from runner.secrets.sources import SecretSource, name_problem
from runner.tools.manifest import Tool

# How a pooled tool's calls start: from warm sandboxes started ahead, or each forked from
# a template of the tool (Python tools on the subprocess backend, as root).
PoolMode = Literal["warm", "fork"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleModel(_Strict):
    inherits: list[str] = Field(default_factory=list)
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)


class CeilingsModel(ResourceSettings):
    network: bool = False


class ToolOverrideModel(CallSettings):
    sandbox: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9_-]{0,63}$")  # an installed backend
    runtime: str | None = None  # OCI runtime for docker tools, e.g. runsc
    network: NetworkAllow | None = None  # the egress this tool is granted
    secrets: list[str] = Field(default_factory=list)  # the secrets this tool is granted
    pool: int | None = Field(default=None, ge=0, le=64)  # warm sandboxes kept for it
    pool_mode: PoolMode | None = None  # None: as ``pool.mode`` says
    session: bool | None = None  # None: as its manifest says


class PoolModel(_Strict):
    """Warm sandboxes: ``size`` per tool unless ``tools.NAME.pool`` says. In ``fork``
    mode a pooled tool has one template instead, and each call is forked from it."""

    size: int = Field(default=0, ge=0, le=64)
    mode: PoolMode = "warm"
    max_idle_ms: int = Field(default=60000, gt=0)
    max_total: int = Field(default=16, ge=0)


class SessionModel(_Strict):
    """Session sandboxes: each one's idle and whole lifetime, and how many may be open."""

    idle_ms: int = Field(default=300_000, ge=100, le=86_400_000)
    max_ms: int = Field(default=3_600_000, ge=100, le=604_800_000)
    max_total: int = Field(default=16, gt=0, le=4096)  # in the whole runner
    max_per_token: int = Field(default=4, gt=0, le=4096)  # of one client (a serve token)


class BreakerModel(_Strict):
    failure_threshold: int = Field(default=5, gt=0)
    reset_timeout_ms: int = Field(default=30000, ge=0)


class AuditModel(_Strict):
    path: str | None = None
    # Refuse a call whose policy.decision event cannot be written, rather than run it unrecorded.
    required: bool = False
    operator_log: str | None = None  # runner faults' tracebacks; standard error when unset
    # Every event carries prevHash and hash, so that `runner audit verify` finds an
    # edited, removed or inserted line. Needs a file: standard error cannot be chained.
    chain: bool = False
    # HMAC-SHA256 under this key instead of SHA-256: without it, a rewritten chain cannot verify.
    key: ChainKeySource | None = None

    @model_validator(mode="after")
    def _key_needs_chain(self) -> AuditModel:
        if self.key is not None and not self.chain:
            raise ValueError("audit.key keys the hash chain: set chain: true too")
        return self


# Settings that moved into the backends' own configuration, and where they live now.
_MOVED = {
    "allow_degraded": "sandbox.backends.subprocess.allow_degraded",
    "docker_runtime": "sandbox.backends.docker.runtime",
}


class SandboxModel(_Strict):
    # Each backend's own settings, by backend name; the backend validates its mapping.
    backends: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in _MOVED.items():
                if old in data:
                    raise ValueError(f"sandbox.{old} is now {new}")
        return data


class ServeTokenModel(_Strict):
    """A bearer token of `runner serve --http`: only its SHA-256 is kept, with a name and a role."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")  # written into audit events as `client`
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: str


class ServeConnectionsModel(_Strict):
    """Bounds on the connections of each listener of `runner serve` (MCP and metrics)."""

    max_open: int = Field(default=1024, gt=0, le=65536)  # in all; the soft RLIMIT_NOFILE may lower it
    max_per_peer: int = Field(default=256, gt=0, le=65536)  # from one IP address
    header_timeout_ms: int = Field(default=10000, ge=100, le=300000)  # for a request's whole head
    # Between requests of a kept-alive one: longer than clients keep an idle one (httpx, the
    # MCP SDK's: 5 s), so a client never reuses a connection the server is closing.
    idle_timeout_ms: int = Field(default=15000, ge=100, le=3600000)


class ServeSocketModel(_Strict):
    """`runner serve --socket`: who besides the server's own user may call, and as what role."""

    uids: dict[int, str] = Field(default_factory=dict)  # uid -> the role of all its calls
    max_open: int = Field(default=64, gt=0, le=4096)  # connections at once; more are closed unread
    read_timeout_ms: int = Field(default=5000, ge=100, le=300000)  # for a request's whole line


class ServeModel(_Strict):
    tokens: list[ServeTokenModel] = Field(default_factory=list)
    max_concurrent: int = Field(default=32, gt=0, le=4096)  # calls running at once; more wait
    # MCP sessions one token may hold open; one more is refused (429), so a token that opens
    # sessions in a loop locks out only itself.
    max_sessions_per_token: int = Field(default=16, gt=0, le=1024)
    # A session with no request in flight and no open event stream this long is closed.
    session_idle_ms: int = Field(default=600_000, ge=1000, le=86_400_000)
    connections: ServeConnectionsModel = Field(default_factory=ServeConnectionsModel)
    socket: ServeSocketModel = Field(default_factory=ServeSocketModel)

    @model_validator(mode="after")
    def _unique(self) -> ServeModel:
        for what in ("name", "sha256"):
            values = [getattr(token, what) for token in self.tokens]
            if len(values) != len(set(values)):
                raise ValueError(f"two tokens have the same {what}")
        return self


class PolicyModel(_Strict):
    version: Literal[1]
    default_role: str | None = None
    whitelist: list[str] = Field(default_factory=list)
    disabled: list[str] = Field(default_factory=list)
    roles: dict[str, RoleModel] = Field(default_factory=dict)
    defaults: CallSettings = Field(default_factory=CallSettings)
    limits: CeilingsModel = Field(default_factory=CeilingsModel)
    tools: dict[str, ToolOverrideModel] = Field(default_factory=dict)
    circuit_breaker: BreakerModel = Field(default_factory=BreakerModel)
    workspace: str | None = None
    audit: AuditModel = Field(default_factory=AuditModel)
    sandbox: SandboxModel = Field(default_factory=SandboxModel)
    serve: ServeModel = Field(default_factory=ServeModel)
    secrets: dict[str, SecretSource] = Field(default_factory=dict)  # where each value comes from
    pool: PoolModel = Field(default_factory=PoolModel)
    session: SessionModel = Field(default_factory=SessionModel)
    dispatch: DispatchModel | None = None  # sandboxes on a Ray cluster's nodes
    approval: ApprovalModel | None = None  # calls a person must approve first

    @model_validator(mode="after")
    def _secrets_have_sources(self) -> PolicyModel:
        for name in self.secrets:
            if (problem := name_problem(name)) is not None:
                raise ValueError(f"secrets: {problem}")
        for tool, override in self.tools.items():
            for name in override.secrets:
                if name not in self.secrets:
                    raise ValueError(f"tools.{tool}.secrets: {name} has no source under secrets:")
        return self

    @model_validator(mode="after")
    def _roles_resolve(self) -> PolicyModel:
        for name in self.roles:
            _expand_role(self.roles, name, ())
        if self.default_role is not None and self.default_role not in self.roles:
            raise ValueError(f"default_role {self.default_role!r} is not a defined role")
        for token in self.serve.tokens:
            if token.role not in self.roles:
                raise ValueError(f"serve token {token.name!r} has role {token.role!r}, which is not defined")
        approval_roles = self.approval.roles if self.approval is not None else None
        for role in approval_roles or ():
            if role not in self.roles:
                raise ValueError(f"approval.roles names {role!r}, which is not a defined role")
        for uid, role in self.serve.socket.uids.items():
            if role not in self.roles:
                raise ValueError(f"serve.socket.uids: uid {uid} has role {role!r}, which is not defined")
        return self


def _expand_role(
    roles: dict[str, RoleModel], name: str, chain: tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """All allow and deny rules of ``name``, its ancestors' included."""
    if name in chain:
        raise ValueError(f"role inheritance cycle: {' -> '.join((*chain, name))}")
    if name not in roles:
        raise ValueError(f"role {chain[-1]!r} inherits unknown role {name!r}")
    role = roles[name]
    allow, deny = list(role.allow), list(role.deny)
    for parent in role.inherits:
        parent_allow, parent_deny = _expand_role(roles, parent, (*chain, name))
        allow += parent_allow
        deny += parent_deny
    return allow, deny


@dataclass(frozen=True)
class PolicyDecision:
    """The outcome of the policy check; ``rule`` is the pattern that decided, if any."""

    allowed: bool
    reason: str
    role: str | None
    rule: str | None = None


def matching_rule(patterns: list[str], tool: Tool) -> str | None:
    """The first pattern (name, glob or ``tag:TAG``) that matches ``tool``."""
    for pattern in patterns:
        if pattern.startswith("tag:"):
            if pattern[4:] in tool.manifest.tags:
                return pattern
        elif fnmatch.fnmatchcase(tool.name, pattern):
            return pattern
    return None


class Policy:
    """A loaded policy file and the decisions it makes."""

    def __init__(self, model: PolicyModel, base_dir: Path, source: str = "policy") -> None:
        self.model = model
        self.base_dir = base_dir
        self.source = source  # the file it came from, for messages
        self.generation = 0  # the runner's reload it came with (session sandboxes go by it)
        self._roles = {name: _expand_role(model.roles, name, ()) for name in model.roles}

    @classmethod
    def load(cls, path: Path) -> Policy:
        """Load and validate a policy file.

        Raises:
            ConfigError: the file is missing, unreadable or invalid (see
                ``yaml_files.load_yaml_file`` for the bounds on the file itself).
        """
        source = str(path)
        try:
            raw = load_yaml_file(path)
        except OSError as exc:
            raise ConfigError(source, f"cannot read policy file: {exc.strerror}") from exc
        except YamlFileError as exc:
            raise ConfigError(source, str(exc)) from exc
        if not isinstance(raw, dict):
            raise ConfigError(source, "a policy file must be a mapping")
        try:
            model = PolicyModel.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(source, pydantic_problem(exc.errors()[0], PolicyModel)) from exc
        base_dir = path.resolve().parent
        # No dispatch without the cluster's token: refused here, before any call.
        if model.dispatch is not None and (problem := token_problem(model.dispatch, base_dir)):
            raise ConfigError(source, problem)
        return cls(model, base_dir, source)

    @property
    def workspace(self) -> Path | None:
        if self.model.workspace is None:
            return None
        # Not resolve(): a symlink on the way is the backend's to refuse, never to follow.
        return Path(os.path.abspath(self.base_dir / self.model.workspace))  # noqa: PTH100

    @property
    def audit_path(self) -> Path | None:
        if self.model.audit.path is None:
            return None
        return self.base_dir / self.model.audit.path

    @property
    def operator_log_path(self) -> Path | None:
        if self.model.audit.operator_log is None:
            return None
        return self.base_dir / self.model.audit.operator_log

    def read_at_start_changed(self, old: Policy) -> list[str]:
        """The keys a runner reads only at its start (the audit trail, the backends, the
        cluster, the server's bounds) that differ from ``old``'s: a reload that took them
        silently would leave a stricter setting unenforced."""
        keys = ("audit", "sandbox", "dispatch", "serve.max_concurrent", "serve.connections")

        def at(model: PolicyModel, key: str) -> object:
            return functools.reduce(getattr, key.split("."), model)

        return [key for key in keys if at(self.model, key) != at(old.model, key)]

    def granted_secrets(self, tool: Tool) -> list[str]:
        """The secrets ``tool`` asks for that the policy grants it, in the manifest's order."""
        override = self.model.tools.get(tool.name)
        granted = set(override.secrets) if override is not None else set()
        return [name for name in tool.manifest.secrets if name in granted]

    def approval_for(self, tool: Tool, role: str | None) -> ApprovalModel | None:
        """The ``approval:`` a call of ``tool`` by ``role`` (already resolved) waits for, if any."""
        approval = self.model.approval
        if approval is None or matching_rule(approval.tools, tool) is None:
            return None
        return approval if approval.roles is None or role in approval.roles else None

    def approving_roles(self, tool: Tool) -> list[str]:
        """The roles that may call ``tool`` only once a person approves, by name."""
        return sorted(
            role
            for role in self.model.roles
            if self.decide(tool, role).allowed and self.approval_for(tool, role) is not None
        )

    def resolve_role(self, role: str | None) -> str | None:
        return role if role is not None else self.model.default_role

    def decide(self, tool: Tool, role: str | None) -> PolicyDecision:
        """May ``role`` call ``tool``? Deny wins; anything not allowed is denied."""
        model = self.model
        role = self.resolve_role(role)
        rule = matching_rule(model.whitelist, tool)
        if rule is None:
            return PolicyDecision(False, "not_whitelisted", role)
        rule = matching_rule(model.disabled, tool)
        if rule is not None:
            return PolicyDecision(False, "disabled", role, rule)
        if role is None:
            return PolicyDecision(False, "no_role", role)
        if role not in self._roles:
            return PolicyDecision(False, "unknown_role", role)
        allow, deny = self._roles[role]
        rule = matching_rule(deny, tool)
        if rule is not None:
            return PolicyDecision(False, "denied_by_role", role, rule)
        allow_rule = matching_rule(allow, tool)
        if allow_rule is None:
            return PolicyDecision(False, "not_allowed", role)
        if tool.manifest.network is not False and not model.limits.network:
            return PolicyDecision(False, "network", role, "limits.network")
        override = model.tools.get(tool.name)
        if isinstance(tool.manifest.network, NetworkAllow) and (override is None or override.network is None):
            return PolicyDecision(False, "network", role, f"tools.{tool.name}.network")
        if tool.manifest.workspace != "none" and self.workspace is None:
            return PolicyDecision(False, "no_workspace", role, "workspace")
        if len(self.granted_secrets(tool)) < len(tool.manifest.secrets):
            return PolicyDecision(False, "secret", role, f"tools.{tool.name}.secrets")
        return PolicyDecision(True, "allowed", role, allow_rule)
