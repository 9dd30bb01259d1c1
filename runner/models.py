"""The wire format: requests in (pydantic, untrusted), answers out (plain dicts).

camelCase on the wire; the snake_case names are accepted on input as well.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from runner.errors import CallError, ErrorCode

MAX_ID_LENGTH = 256


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class CallOptions(_Wire):
    timeout: int | None = Field(default=None, gt=0)
    retries: int | None = Field(default=None, ge=0, le=10)
    retry_delay: int | None = Field(default=None, ge=0)
    format: Literal["json", "raw"] = "json"
    deadline: int | None = Field(default=None, gt=0)


class CallRequest(_Wire):
    tool_name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    params: dict[str, Any] = Field(default_factory=dict)
    options: CallOptions = Field(default_factory=CallOptions)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH)
    step_id: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    role: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    metadata: dict[str, Any] = Field(default_factory=dict)


class DiscoverOptions(_Wire):
    filter: str | None = Field(default=None, max_length=MAX_ID_LENGTH)


class DiscoverRequest(_Wire):
    action: Literal["discover"]
    options: DiscoverOptions = Field(default_factory=DiscoverOptions)
    role: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH)
    metadata: dict[str, Any] = Field(default_factory=dict)


def parse_request(raw: object) -> CallRequest | DiscoverRequest:
    """Validate a request document.

    Raises:
        CallError: INVALID_PARAMS naming the first field that is wrong.
    """
    if not isinstance(raw, dict):
        raise CallError(
            ErrorCode.INVALID_PARAMS,
            "request must be a JSON object",
            {"field": "(root)", "problem": "not an object"},
        )
    model: type[CallRequest | DiscoverRequest] = DiscoverRequest if "action" in raw else CallRequest
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or "(root)"
        raise CallError(
            ErrorCode.INVALID_PARAMS,
            f"invalid request: {field}: {error['msg']}",
            {"field": field, "problem": error["msg"]},
        ) from exc


def peek(raw: object, *keys: str) -> str | None:
    """A string field of a request that may not have validated, for answers and audit."""
    if not isinstance(raw, dict):
        return None
    for key in keys:
        value = raw.get(key)
        if isinstance(value, str):
            return value[:MAX_ID_LENGTH]
    return None
