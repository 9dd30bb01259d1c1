"""The policy's ``approval:`` section: which calls wait for a person to say yes.

``tools`` takes names, globs and ``tag:TAG`` (as a role's ``allow`` does); ``roles`` the
roles whose calls need it (unset: every role); ``timeout_ms`` how long an answer is waited
for. There is no setting that skips it: a role that should not need it is left out of
``roles``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_TIMEOUT_MS = 120_000
MAX_TIMEOUT_MS = 86_400_000  # a day: longer than any person leaves a prompt open


class ApprovalModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: list[str] = Field(min_length=1)
    roles: list[str] | None = None
    timeout_ms: int = Field(default=DEFAULT_TIMEOUT_MS, gt=0, le=MAX_TIMEOUT_MS, strict=True)

    @field_validator("tools")
    @classmethod
    def _patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if not pattern or pattern == "tag:":
                raise ValueError("an empty pattern matches no tool: name a tool, a glob or tag:TAG")
        return patterns

    @field_validator("roles")
    @classmethod
    def _some_role(cls, roles: list[str] | None) -> list[str] | None:
        if roles is not None and not roles:
            raise ValueError("an empty list asks no role: leave roles out for every role")
        return roles
