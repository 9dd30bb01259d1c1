"""The wire format: requests in (pydantic, untrusted), answers out (plain dicts).

camelCase on the wire; the snake_case names are accepted on input as well.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from runner.errors import CallError, ErrorCode
from runner.schema.strict_json import MAX_DEPTH, depth

MAX_ID_LENGTH = 256
# Bounds on what a caller may ask for; the policy's ceilings then cap them further.
MAX_TIMEOUT_MS = 3_600_000
MAX_RETRY_DELAY_MS = 600_000
MAX_DEADLINE_MS = 3_600_000
MAX_PARAMS_BYTES = 8 * 1024 * 1024
MAX_PARAMS_DEPTH = MAX_DEPTH
MAX_REQUEST_ERRORS = 20  # failing fields of a request listed in its INVALID_PARAMS answer
# Printable text only: ids end up in environments, argv, audit lines and messages.
ID_PATTERN = r"^[^\x00-\x1f\x7f]*$"  # lone surrogates are refused by check_json


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class CallOptions(_Wire):
    # strict: ``true`` or ``"100"`` is not a number of milliseconds
    timeout: int | None = Field(default=None, gt=0, le=MAX_TIMEOUT_MS, strict=True)
    retries: int | None = Field(default=None, ge=0, le=10, strict=True)
    retry_delay: int | None = Field(default=None, ge=0, le=MAX_RETRY_DELAY_MS, strict=True)
    format: Literal["json", "raw"] = "json"
    deadline: int | None = Field(default=None, gt=0, le=MAX_DEADLINE_MS, strict=True)


class CallRequest(_Wire):
    tool_name: str = Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    params: dict[str, Any] = Field(default_factory=dict)
    options: CallOptions = Field(default_factory=CallOptions)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    step_id: str | None = Field(default=None, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    role: str | None = Field(default=None, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    metadata: dict[str, Any] = Field(default_factory=dict)


class DiscoverOptions(_Wire):
    filter: str | None = Field(default=None, max_length=MAX_ID_LENGTH)


class DiscoverRequest(_Wire):
    action: Literal["discover"]
    options: DiscoverOptions = Field(default_factory=DiscoverOptions)
    role: str | None = Field(default=None, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    metadata: dict[str, Any] = Field(default_factory=dict)


def check_json(raw: dict[str, Any]) -> None:
    """The request must be plain JSON the tool can be sent: bounded depth and size, valid text."""
    if depth(raw, MAX_PARAMS_DEPTH) > MAX_PARAMS_DEPTH:
        raise CallError(
            ErrorCode.INVALID_PARAMS,
            f"request nests deeper than {MAX_PARAMS_DEPTH} levels",
            {"field": "params", "problem": "too deep"},
        )
    try:
        # allow_nan=False: NaN and Infinity (floats from Python, or from a lenient parser)
        # are not JSON; a tool must never receive them.
        size = len(json.dumps(raw, ensure_ascii=False, allow_nan=False).encode("utf-8"))
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        if isinstance(exc, UnicodeError):
            problem = "text holds a lone surrogate, which is not Unicode"
        elif isinstance(exc, ValueError):
            problem = "NaN, Infinity and circular values are not JSON"
        else:  # TypeError: a Python value with no JSON form (a set, bytes, an object)
            problem = "only objects, arrays, strings, numbers, true, false and null are JSON"
        raise CallError(
            ErrorCode.INVALID_PARAMS,
            "request is not plain JSON text",
            {"field": "(root)", "problem": problem},
        ) from exc
    if size > MAX_PARAMS_BYTES:
        raise CallError(
            ErrorCode.INVALID_PARAMS,
            f"request is larger than {MAX_PARAMS_BYTES} bytes",
            {"field": "params", "problem": "too large"},
        )


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
    check_json(raw)
    model: type[CallRequest | DiscoverRequest] = DiscoverRequest if "action" in raw else CallRequest
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        found = [(".".join(str(p) for p in error["loc"]) or "(root)", error["msg"]) for error in exc.errors()]
        field, message = found[0]
        more = f" (and {len(found) - 1} more: details.errors lists them)" if len(found) > 1 else ""
        raise CallError(
            ErrorCode.INVALID_PARAMS,
            f"invalid request: {field}: {message}{more}",
            {
                "field": field,
                "problem": message,
                "errors": [{"path": path, "message": text} for path, text in found[:MAX_REQUEST_ERRORS]],
            },
        ) from exc


def peek(raw: object, *keys: str) -> str | None:
    """A string field of a request that may not have validated, for answers and audit."""
    if not isinstance(raw, dict):
        return None
    for key in keys:
        value = raw.get(key)
        if isinstance(value, str):
            # A lone surrogate (a JSON escape of half a pair) is no Unicode: U+FFFD in its
            # place, or the audit trail and the answer would not be strict JSON text.
            return value[:MAX_ID_LENGTH].encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return None


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def wire_request(tool_name: str, params: Mapping[str, Any] | None, options: dict[str, Any]) -> dict[str, Any]:
    request: dict[str, Any] = {"toolName": tool_name, "params": dict(params or {})}
    wire_options = {
        k: options.pop(k) for k in ("timeout", "retries", "retry_delay", "deadline", "format") if k in options
    }
    if wire_options:
        request["options"] = wire_options
    request.update(options)
    return request
