"""runner: a sandboxed tool runner for LLM agents (host side).

The public names are imported on first use (PEP 562): ``python3 -m runner --help`` and
every command that does not call a tool must not pay for pydantic, jsonschema and the
sandboxes, which ``Runner`` brings in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.api import Runner
    from runner.call.answers import AnswerMetadata, CallResult, ErrorInfo
    from runner.config.locations import examples_dir
    from runner.errors import CallError, ConfigError, ErrorCode, RunnerError

_HOMES = {
    "AnswerMetadata": "runner.call.answers",
    "CallResult": "runner.call.answers",
    "ErrorInfo": "runner.call.answers",
    "Runner": "runner.api",
    "CallError": "runner.errors",
    "ConfigError": "runner.errors",
    "ErrorCode": "runner.errors",
    "RunnerError": "runner.errors",
    "examples_dir": "runner.config.locations",
}

__all__ = [
    "AnswerMetadata",
    "CallError",
    "CallResult",
    "ConfigError",
    "ErrorCode",
    "ErrorInfo",
    "Runner",
    "RunnerError",
    "examples_dir",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
