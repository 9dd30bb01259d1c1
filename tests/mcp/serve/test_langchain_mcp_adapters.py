"""`langchain-mcp-adapters` against the real `runner serve`, stdio and HTTP.

It needs the mcp SDK 1.x and the runner the 2.x, so it runs from an environment of its
own (scripts/setup.sh makes it: /opt/runner-langchain, or $RUNNER_LANGCHAIN_PYTHON), as a
client process of the server. A failed call (the runner's ``isError`` result) is, by the
adapter's default, a ToolMessage with ``status="error"`` carrying the runner's text; with
``handle_tool_errors=False``, a ``ToolException`` with that text.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench
from support.mcp_harness import HttpServer, add_token, server_argv

ADD = 'import json, sys\np = json.load(sys.stdin)["params"]\njson.dump(p["a"] + p["b"], sys.stdout)\n'
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
CLIENT = Path(__file__).resolve().parents[2] / "support" / "langchain_client.py"


def langchain_python() -> str:
    python = os.environ.get("RUNNER_LANGCHAIN_PYTHON", "/opt/runner-langchain/bin/python")
    if not Path(python).is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"no langchain-mcp-adapters environment at {python}: scripts/setup.sh makes it")
        pytest.skip(f"no langchain-mcp-adapters environment at {python} (scripts/setup.sh makes it)")
    return python


def run_client(connection: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [langchain_python(), str(CLIENT), json.dumps(connection)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return seen


def assert_seen(seen: dict[str, Any]) -> None:
    assert seen["tools"] == ["add"]
    assert seen["ok"] == ["5"]
    assert seen["status"] == "error" and "INVALID_PARAMS" in seen["message"]
    assert seen["raised"] is not None and seen["raised"].startswith("INVALID_PARAMS")


@pytest.fixture
def adder(bench: ToolBench) -> ToolBench:
    bench.tool("add", ADD, parameters=ADD_PARAMS)
    return bench


def test_langchain_mcp_adapters_over_runner_serve_stdio(adder: ToolBench) -> None:
    argv = server_argv(adder, "--stdio")
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]}
    assert_seen(run_client({"transport": "stdio", "command": argv[0], "args": argv[1:], "env": env}))


def test_langchain_mcp_adapters_over_runner_serve_http_with_a_token(adder: ToolBench) -> None:
    token = add_token(adder, "langchain", "user")
    http = HttpServer(adder)
    try:
        headers = {"Authorization": f"Bearer {token}"}
        assert_seen(run_client({"transport": "streamable_http", "url": http.url, "headers": headers}))
    finally:
        assert http.stop() == 0
