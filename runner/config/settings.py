"""The limit and retry settings of a call: one model for every place that may set them.

The manifest's ``limits``, the policy's ``defaults`` and ``tools.NAME``, and the call's
options are all ``CallSettings``; the policy's ``limits`` ceilings are
``ResourceSettings`` (plus ``network``). A call's plan takes, for each field, the first
layer that sets it (``first_set``). The built-in defaults live in one place: the resource
limits' in ``sandboxes.Limits``, the retries' here.
"""

from __future__ import annotations

from dataclasses import fields

from pydantic import BaseModel, ConfigDict, Field

from sandboxes import Limits

WEEK_MS = 7 * 24 * 3600 * 1000


class ResourceSettings(BaseModel):
    """What one attempt may use (unset: decided by a later layer)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The upper bounds are what the sandboxes can set (a cgroup's bytes, the kernel's pid
    # range, the shell's numbers): past them a value passed validation and then failed
    # every call with a message of the sandbox's.
    timeout_ms: int | None = Field(default=None, gt=0, le=WEEK_MS)
    memory_mb: int | None = Field(default=None, gt=0, le=1 << 30)
    cpu_seconds: int | None = Field(default=None, gt=0, le=WEEK_MS // 1000)
    max_pids: int | None = Field(default=None, gt=0, le=1 << 22)
    max_output_bytes: int | None = Field(default=None, gt=0, le=1 << 40)
    disk_mb: int | None = Field(default=None, gt=0, le=1 << 30)


class CallSettings(ResourceSettings):
    """Resources, and how a call is retried within its deadline."""

    retries: int | None = Field(default=None, ge=0, le=10)
    retry_delay_ms: int | None = Field(default=None, ge=0, le=WEEK_MS)
    deadline_ms: int | None = Field(default=None, gt=0, le=WEEK_MS)


RESOURCE_FIELDS = tuple(ResourceSettings.model_fields)
CALL_FIELDS = tuple(CallSettings.model_fields)
# Every Limits field but network is a resource setting: the two cannot drift apart.
assert {f.name for f in fields(Limits)} - {"network"} == set(RESOURCE_FIELDS)

_LIMITS = Limits()
BUILTIN = CallSettings(
    **{name: getattr(_LIMITS, name) for name in RESOURCE_FIELDS},
    retries=3,
    retry_delay_ms=1000,
    deadline_ms=5000,
)


def first_set(*layers: CallSettings) -> dict[str, int]:
    """For each field, the value of the first layer that sets it; ``BUILTIN`` is last."""
    resolved: dict[str, int] = {}
    for name in CALL_FIELDS:
        for layer in (*layers, BUILTIN):
            value = getattr(layer, name)
            if value is not None:
                resolved[name] = value
                break
    return resolved
