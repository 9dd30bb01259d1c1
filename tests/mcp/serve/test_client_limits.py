"""`runner serve` warns the operator when a client known to end calls at a fixed time
(Claude Desktop, by its clientInfo name) is listed tools whose deadline outlasts that."""

from __future__ import annotations

import os
from pathlib import Path

import mcp_types as types
import pytest
from conftest import ToolBench
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from support.mcp_harness import ECHO, server_argv

from runner.mcp.serve.client_limits import gives_up_first


async def _list_as(bench: ToolBench, tmp_path: Path, client_name: str) -> str:
    argv = server_argv(bench, "--stdio")
    params = StdioServerParameters(
        command=argv[0], args=argv[1:], cwd=str(bench.root), env={"PYTHONPATH": os.environ["PYTHONPATH"]}
    )
    errors = tmp_path / f"{client_name}.stderr"
    with errors.open("w") as errlog:
        info = types.Implementation(name=client_name, version="1.0")
        async with Client(stdio_client(params, errlog=errlog), client_info=info, mode="legacy") as client:
            await client.list_tools()
    return errors.read_text()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_client_with_a_known_shorter_limit_is_named_in_the_operator_log(
    bench: ToolBench, tmp_path: Path
) -> None:
    bench.tool("slow", ECHO)
    bench.policy["tools"] = {"slow": {"deadline_ms": 90_000}}
    stderr = await _list_as(bench, tmp_path, "claude-ai")
    assert "runner: warning: serve: client 'claude-ai' ends a call after 60 s" in stderr
    assert "90000 ms" in stderr
    assert "warning" not in await _list_as(bench, tmp_path, "some-other-client")  # its timeout is unknown


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_no_warning_when_every_deadline_fits_the_clients_limit(
    bench: ToolBench, tmp_path: Path
) -> None:
    bench.tool("quick", ECHO)  # the default deadline (10 s here)
    assert "warning" not in await _list_as(bench, tmp_path, "claude-ai")


def test_only_a_known_client_with_a_shorter_limit_is_reported() -> None:
    assert gives_up_first("claude-ai", 60_000) == 60.0
    assert gives_up_first("claude-ai", 59_999) is None
    assert gives_up_first(None, 10**9) is None and gives_up_first("cursor", 10**9) is None
