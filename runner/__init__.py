"""runner: a sandboxed tool runner for LLM agents (host side)."""

from runner.answers import AnswerMetadata, CallResult, ErrorInfo
from runner.api import Runner
from runner.errors import CallError, ConfigError, ErrorCode, RunnerError
from runner.locations import examples_dir

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
