"""The ``tool.yaml`` manifest: an untrusted file, validated strictly at load time."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runner.config.egress import NetworkAllow
from runner.config.settings import CallSettings
from runner.config.yaml_files import YamlFileError, parse_yaml, read_bounded
from runner.schema.suggest import pydantic_problem
from runner.secrets.sources import name_problem
from runner.tools.cache import ManifestCache, digest
from sandboxes import ToolRequirements

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

    from runner.schema.compiled import SensitivePath

MANIFEST_FILE = "tool.yaml"
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
BACKEND_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables the runner sets itself; a manifest may not override them.
RESERVED_ENV = frozenset(
    {"HOME", "TMPDIR", "TOOL_NAME", "REQUEST_ID", "WORKSPACE"}
    | {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"}  # the egress proxy's
)
# The launcher reads RUNNER_* (and runs as root); LD_* would steer it before the tool.
RESERVED_ENV_PREFIXES = ("RUNNER_", "LD_")


class AnnotationsModel(BaseModel):
    """Hints for agents, exported as MCP's ``readOnlyHint`` and the like."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    read_only: bool | None = Field(default=None, alias="readOnly")
    destructive: bool | None = None
    idempotent: bool | None = None
    open_world: bool | None = Field(default=None, alias="openWorld")


class LaunchModel(BaseModel):
    """What every manifest says about running its program: a tool's and an MCP server's
    (``kind: mcp``, ``ServerManifestModel`` below) alike."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: str | None = None
    tags: list[str] = Field(default_factory=list)
    command: list[str] = Field(min_length=1)
    sandbox: str = "subprocess"  # any installed backend (entry point group runner.sandboxes)
    image: str | None = None
    limits: CallSettings = Field(default_factory=CallSettings)
    network: bool | NetworkAllow = False  # true: a network of its own; allow: the egress proxy
    workspace: Literal["none", "read", "write"] = "none"
    env: dict[str, str] = Field(default_factory=dict)
    secrets: list[str] = Field(default_factory=list)  # granted per tool by the policy
    annotations: AnnotationsModel = Field(default_factory=AnnotationsModel)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_PATTERN.fullmatch(value):
            raise ValueError("must match [a-z][a-z0-9_.-]{0,63}")
        return value

    @field_validator("sandbox")
    @classmethod
    def _sandbox(cls, value: str) -> str:
        if not BACKEND_NAME.fullmatch(value):
            raise ValueError("must match [a-z][a-z0-9_-]{0,63}")
        return value

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if not value[0] or any("\0" in part for part in value):
            raise ValueError("command[0] must be a program name and no part may hold NUL")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a variable name")
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"{key} is set by the runner and cannot be overridden")
            if "\0" in text:  # it would end the value where the sandbox reads it
                raise ValueError(f"the value of {key} holds a NUL byte")
        return value

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, value: list[str]) -> list[str]:
        for name in value:
            problem = name_problem(name)
            if problem is not None:
                raise ValueError(problem)
        if len(set(value)) != len(value):
            raise ValueError("a secret is listed twice")
        return value

    @model_validator(mode="after")
    def _secrets_not_in_env(self) -> Self:
        both = sorted(set(self.secrets) & set(self.env))
        if both:
            raise ValueError(f"{both[0]} is both a secret and an env variable")
        return self


class ManifestModel(LaunchModel):
    description: str = Field(min_length=1, max_length=1000)
    parameters: dict[str, Any]
    output_schema: dict[str, Any] | bool | None = None
    session: bool = False  # one sandbox per session, kept between its calls

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError("must be a JSON Schema with type: object")
        return value


@dataclass(frozen=True)
class HostedTool:
    """Where a tool of an MCP server comes from: the server's manifest name and
    the tool's own name on that server."""

    server: str
    tool: str


@dataclass(frozen=True)
class Tool:
    """A registered tool: its manifest (schemas checked) and its folder.

    Its validators are built when a call first needs them and kept: most loads (a CLI
    command, a server's start) call few of the tools they load, and jsonschema itself is
    imported only then.
    """

    manifest: ManifestModel
    directory: Path
    hosted: HostedTool | None = None  # a tool of a third-party MCP server

    @property
    def name(self) -> str:
        return self.manifest.name

    @cached_property
    def params_validator(self) -> Validator:
        from runner.schema.compiled import build_validator

        return build_validator(self.manifest.parameters)

    @cached_property
    def output_validator(self) -> Validator | None:
        from runner.schema.compiled import build_validator

        schema = self.manifest.output_schema
        return None if schema is None else build_validator(schema)

    @cached_property
    def params_linear(self) -> bool:
        """Whether the params' schema validates in one pass (``runner.schema.inline``)."""
        from runner.schema.inline import is_linear

        return is_linear(self.manifest.parameters)

    @cached_property
    def output_linear(self) -> bool:
        """Whether a result is checked in one pass: no ``output_schema``, or a linear one."""
        from runner.schema.inline import is_linear

        schema = self.manifest.output_schema
        return schema is None or is_linear(schema)

    @cached_property
    def sensitive_params(self) -> frozenset[SensitivePath]:
        from runner.schema.compiled import sensitive_paths

        return sensitive_paths(self.manifest.parameters)

    def requirements(self) -> ToolRequirements:
        """What the manifest asks of its backend, for the backend's own rules."""
        manifest = self.manifest
        return ToolRequirements(
            name=manifest.name,
            command=tuple(manifest.command),
            image=manifest.image,
            network=manifest.network is not False,
            workspace_mode=manifest.workspace,
        )


class ManifestError(ValueError):
    """A manifest that cannot be registered; ``path`` and ``reason`` say where and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _describe(exc: ValidationError, model: type[BaseModel]) -> str:
    return "; ".join(pydantic_problem(error, model) for error in exc.errors()[:3])


class ServerManifestModel(LaunchModel):
    """``kind: mcp``: a stdio MCP server whose tools register one by one."""

    kind: Literal["mcp"]
    description: str | None = Field(default=None, min_length=1, max_length=1000)
    tools: list[str] | None = None  # expose only these of the server's tools
    prefix: str | None = None  # before each tool's name; default NAME_, "" keeps the server's
    session: bool = False  # one server per session, shared by its tools, kept between calls

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("a tool is listed twice")
        return value

    @property
    def tool_prefix(self) -> str:
        return f"{self.name}_" if self.prefix is None else self.prefix


@dataclass(frozen=True)
class ServerEntry:
    """A tool folder that holds an MCP server's manifest; ``key`` is its bytes' digest."""

    manifest: ServerManifestModel
    directory: Path
    key: str


def load_tool(directory: Path, cache: ManifestCache | None = None) -> Tool:
    """Read and validate ``directory/tool.yaml`` as one tool (``load_entry``).

    Raises:
        ManifestError: as ``load_entry``, or the folder holds an MCP server's manifest.
    """
    entry = load_entry(directory, cache)
    if not isinstance(entry, Tool):
        raise ManifestError(
            directory / MANIFEST_FILE, "is an MCP server's manifest (kind: mcp), not a tool's"
        )
    return entry


def load_entry(directory: Path, cache: ManifestCache | None = None) -> Tool | ServerEntry:
    """Read and validate ``directory/tool.yaml``: a tool, or an MCP server (``kind: mcp``)
    whose tools are listed later; ``cache`` skips the YAML and schema checks of a file
    whose very bytes passed them before, and records one that passes now.

    Raises:
        ManifestError: the manifest is missing, unreadable or invalid (see
            ``yaml_files.load_yaml_file`` for the bounds on the file itself).
    """
    path = directory / MANIFEST_FILE
    try:
        data = read_bounded(path)
    except OSError as exc:
        raise ManifestError(path, f"cannot read: {exc.strerror}") from exc
    except YamlFileError as exc:
        raise ManifestError(path, str(exc)) from exc
    key = digest(data)
    known = cache.get(key) if cache is not None else None
    if known is not None:
        with contextlib.suppress(ValidationError):  # not what it was: check it all again
            return _entry(known, directory, key)
    try:
        raw = parse_yaml(data, path.name)
    except YamlFileError as exc:
        raise ManifestError(path, str(exc)) from exc
    if not isinstance(raw, dict):
        raise ManifestError(path, "must be a mapping")
    try:
        entry = _entry(raw, directory, key)
    except ValidationError as exc:
        model = ServerManifestModel if raw.get("kind") == "mcp" else ManifestModel
        raise ManifestError(path, _describe(exc, model)) from exc
    if isinstance(entry, Tool):
        from runner.schema.compiled import SchemaProblem, check_schema

        try:
            check_schema(entry.manifest.parameters)
            if entry.manifest.output_schema is not None:
                check_schema(entry.manifest.output_schema)
        except SchemaProblem as exc:
            raise ManifestError(path, str(exc)) from exc
    if cache is not None:
        cache.put(key, raw)
    return entry


def _entry(raw: dict[str, Any], directory: Path, key: str) -> Tool | ServerEntry:
    """The model ``raw`` asks for by its ``kind``. Raises ValidationError."""
    if "kind" in raw:
        return ServerEntry(ServerManifestModel.model_validate(raw), directory.resolve(), key)
    return Tool(manifest=ManifestModel.model_validate(raw), directory=directory.resolve())
