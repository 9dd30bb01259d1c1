"""The ``tool.yaml`` manifest: an untrusted file, validated strictly at load time."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runner.egress_rules import NetworkAllow
from runner.manifest_cache import ManifestCache, digest
from runner.secrets import name_problem
from runner.settings import CallSettings
from runner.yaml_files import YamlFileError, parse_yaml, read_bounded
from sandboxes import ToolRequirements

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

    from runner.schemas import SensitivePath

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
    """Hints for agents (SPEC 2), exported as MCP's ``readOnlyHint`` and the like."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    read_only: bool | None = Field(default=None, alias="readOnly")
    destructive: bool | None = None
    idempotent: bool | None = None
    open_world: bool | None = Field(default=None, alias="openWorld")


class ManifestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = Field(min_length=1, max_length=1000)
    version: str | None = None
    tags: list[str] = Field(default_factory=list)
    command: list[str] = Field(min_length=1)
    sandbox: str = "subprocess"  # any installed backend (entry point group runner.sandboxes)
    image: str | None = None
    parameters: dict[str, Any]
    output_schema: dict[str, Any] | bool | None = None
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

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError("must be a JSON Schema with type: object")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a variable name")
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"{key} is set by the runner and cannot be overridden")
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
    def _secrets_not_in_env(self) -> ManifestModel:
        both = sorted(set(self.secrets) & set(self.env))
        if both:
            raise ValueError(f"{both[0]} is both a secret and an env variable")
        return self


@dataclass(frozen=True)
class Tool:
    """A registered tool: its manifest (schemas checked) and its folder.

    Its validators are built when a call first needs them and kept: most loads (a CLI
    command, a server's start) call few of the tools they load, and jsonschema itself is
    imported only then.
    """

    manifest: ManifestModel
    directory: Path

    @property
    def name(self) -> str:
        return self.manifest.name

    @cached_property
    def params_validator(self) -> Validator:
        from runner.schemas import build_validator

        return build_validator(self.manifest.parameters)

    @cached_property
    def output_validator(self) -> Validator | None:
        from runner.schemas import build_validator

        schema = self.manifest.output_schema
        return None if schema is None else build_validator(schema)

    @cached_property
    def sensitive_params(self) -> frozenset[SensitivePath]:
        from runner.schemas import sensitive_paths

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


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors()[:3]:
        where = ".".join(str(p) for p in error["loc"]) or "(root)"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def load_tool(directory: Path, cache: ManifestCache | None = None) -> Tool:
    """Read and validate ``directory/tool.yaml``; ``cache`` skips the YAML and schema checks
    of a file whose very bytes passed them before, and records one that passes now.

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
            return Tool(manifest=ManifestModel.model_validate(known), directory=directory.resolve())
    try:
        raw = parse_yaml(data)
    except YamlFileError as exc:
        raise ManifestError(path, str(exc)) from exc
    if not isinstance(raw, dict):
        raise ManifestError(path, "must be a mapping")
    try:
        manifest = ManifestModel.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(path, _describe(exc)) from exc
    from runner.schemas import SchemaProblem, check_schema

    try:
        check_schema(manifest.parameters)
        if manifest.output_schema is not None:
            check_schema(manifest.output_schema)
    except SchemaProblem as exc:
        raise ManifestError(path, str(exc)) from exc
    if cache is not None:
        cache.put(key, raw)
    return Tool(manifest=manifest, directory=directory.resolve())
