"""The real server process and the SDK's real client, for the ``runner serve`` tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from conftest import ToolBench
from mcp import StdioServerParameters

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
# Sleeps for params.seconds (default 60), then answers {"slept": seconds}.
SLEEPER = """
import json, sys, time
seconds = json.load(sys.stdin)["params"].get("seconds", 60)
time.sleep(seconds)
json.dump({"slept": seconds}, sys.stdout)
"""
OBJECT_OUT = {"type": "object", "properties": {"slept": {"type": "number"}}, "required": ["slept"]}
SLOW = {"timeout_ms": 30000}


def write_policy(bench: ToolBench) -> None:
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))


def server_argv(bench: ToolBench, *args: str) -> list[str]:
    """``runner serve ...`` over the bench's tools, policy and audit log."""
    write_policy(bench)
    return [sys.executable, "-m", "runner", "--tools", str(bench.tools), "--policies",
            str(bench.root / "policies.yaml"), "--audit-log", str(bench.audit_log), "serve", *args]


def stdio_server(bench: ToolBench, *args: str, exit_file: Path | None = None) -> StdioServerParameters:
    """The server as an MCP client spawns it; with ``exit_file``, through a shell that
    writes the server's exit status there."""
    argv = server_argv(bench, "--stdio", *args)
    if exit_file is not None:
        argv = ["sh", "-c", '"$@"; echo $? > "$0"', str(exit_file), *argv]
    # The SDK gives the server only an allow-listed environment: PYTHONPATH (set by
    # conftest) makes it import the package under test.
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]}
    return StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(bench.root), env=env)


def server_pid(bench: ToolBench) -> int:
    """The pid of the ``runner serve`` process over this bench (a child of the tests)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if cmdline[:3] == [sys.executable, "-m", "runner"] and str(bench.tools) in cmdline:
            return child.pid
    raise AssertionError("no runner serve process found")


def audit_events(bench: ToolBench, **match: Any) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [e for e in events if all(e.get(k) == v for k, v in match.items())]
