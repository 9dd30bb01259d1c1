"""``runner serve --stdio`` driven by the official MCP client (SDK v2), both protocol eras:
the real server process, real sandboxes."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from collections.abc import Callable
from typing import Any, cast

import anyio
import mcp_types as types
import pytest
from conftest import ToolBench
from mcp import Client
from support.mcp_harness import (
    ECHO,
    OBJECT_OUT,
    SLEEPER,
    SLOW,
    audit_events,
    server_argv,
    server_pid,
    stdio_server,
)

from runner.mcp.serve.app import ERROR_META, REQUEST_ID_META

pytestmark = pytest.mark.anyio
ERAS = ["auto", "legacy"]  # auto: 2026-07-28 (server/discover); legacy: the 2025-11-25 handshake


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def text_of(result: types.CallToolResult) -> str:
    [content] = result.content
    assert isinstance(content, types.TextContent)
    return content.text


@pytest.fixture
def roles_bench(bench: ToolBench) -> ToolBench:
    bench.tool("echo", ECHO, annotations={"readOnly": True, "idempotent": True})
    bench.tool("sleeper", SLEEPER, output_schema=OBJECT_OUT, limits=SLOW)
    bench.policy["roles"] = {"user": {"allow": ["echo"]}, "admin": {"inherits": ["user"], "allow": ["*"]}}
    return bench


@pytest.mark.parametrize("mode", ERAS)
async def test_tools_list_gives_exactly_what_the_role_may_call_with_schemas_and_annotations(
    roles_bench: ToolBench, mode: str
) -> None:
    async with Client(stdio_server(roles_bench), mode=mode) as client:
        assert [t.name for t in (await client.list_tools()).tools] == ["echo"]
    async with Client(stdio_server(roles_bench, "--role", "admin"), mode=mode) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == {"echo", "sleeper"}
    assert tools["echo"].annotations == types.ToolAnnotations(read_only_hint=True, idempotent_hint=True)
    assert tools["echo"].input_schema == {"type": "object", "additionalProperties": True}
    assert tools["sleeper"].output_schema == OBJECT_OUT
    assert tools["echo"].output_schema is None


@pytest.mark.parametrize("mode", ERAS)
async def test_a_success_is_json_text_and_structured_content_when_the_output_schema_is_an_object(
    roles_bench: ToolBench, mode: str
) -> None:
    async with Client(stdio_server(roles_bench, "--role", "admin"), mode=mode) as client:
        slept = await client.call_tool("sleeper", {"seconds": 0})
        echoed = await client.call_tool("echo", {"text": "héllo"})
    assert not slept.is_error
    assert slept.structured_content == {"slept": 0}
    assert json.loads(text_of(slept)) == {"slept": 0}
    assert not echoed.is_error
    assert echoed.structured_content is None  # echo declares no output schema
    assert json.loads(text_of(echoed)) == {"text": "héllo"}


FAILING_TOOLS = {
    "exits_3": "import sys\nsys.stdin.read()\nsys.exit(3)\n",
    "not_json": "import sys\nsys.stdin.read()\nprint('not json')\n",
    "slow": "import sys, time\nsys.stdin.read()\ntime.sleep(30)\n",
}


async def test_every_error_code_is_an_is_error_result_whose_text_begins_with_the_code(
    bench: ToolBench,
) -> None:
    for name, code in FAILING_TOOLS.items():
        bench.tool(name, code, limits={"timeout_ms": 500} if name == "slow" else {})
    bench.tool(
        "flaky", "import sys\nsys.stdin.read()\nsys.exit(1)\n", limits={"retries": 1, "retry_delay_ms": 0}
    )
    bench.tool("strict", ECHO, parameters={"type": "object", "required": ["a"]})
    bench.tool("breaks", "import sys\nsys.stdin.read()\nsys.exit(2)\n")
    bench.tool("forbidden", ECHO)
    bench.policy["roles"] = {"user": {"allow": ["*"], "deny": ["forbidden"]}}
    bench.policy["tools"] = {"breaks": {"retries": 0}}
    bench.policy["circuit_breaker"] = {"failure_threshold": 1, "reset_timeout_ms": 60000}
    expected = {
        ("nope", "TOOL_NOT_FOUND"),
        ("forbidden", "PERMISSION_DENIED"),
        ("strict", "INVALID_PARAMS"),
        ("slow", "TIMEOUT"),
        ("exits_3", "EXECUTION_ERROR"),
        ("not_json", "PARSE_ERROR"),
        ("flaky", "RETRY_EXHAUSTED"),
    }
    async with Client(stdio_server(bench)) as client:
        for tool, code in sorted(expected):
            result = await client.call_tool(tool, {})
            assert result.is_error, tool
            assert text_of(result).startswith(f"{code}: "), (tool, text_of(result))
        # One long-lived runner: the breaker that the first failure opened refuses the second call.
        first = await client.call_tool("breaks", {})
        second = await client.call_tool("breaks", {})
    assert text_of(first).startswith("EXECUTION_ERROR: ")
    assert second.is_error and text_of(second).startswith("CIRCUIT_OPEN: ")


def _rpc(process: subprocess.Popen[str], line: str) -> dict[str, Any]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()
    ready, _, _ = select.select([process.stdout], [], [], 20)
    assert ready, f"no answer to {line}"
    answer: dict[str, Any] = json.loads(process.stdout.readline())
    return answer


def test_requests_the_protocol_rejects_are_json_rpc_errors_and_the_server_keeps_serving(
    bench: ToolBench,
) -> None:
    bench.tool("echo", ECHO)
    argv = server_argv(bench, "--stdio")
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdin is not None and process.stderr is not None
        hello = {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        }
        init = _rpc(process, json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}))
        assert init["result"]["serverInfo"]["name"] == "runner"
        process.stdin.write('{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        unknown = _rpc(process, '{"jsonrpc": "2.0", "id": 2, "method": "tools/nothing"}')
        assert unknown["id"] == 2 and unknown["error"]["code"] == types.METHOD_NOT_FOUND
        bad_params = _rpc(
            process, '{"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": 7}}'
        )
        assert bad_params["id"] == 3 and bad_params["error"]["code"] == types.INVALID_PARAMS
        # Lines the SDK cannot take went unanswered, and their client waited for ever: each
        # gets JSON-RPC's error (with its id when it has one), and the server reads on.
        refused = [
            _rpc(process, line)
            for line in (
                '{"jsonrpc": "2.0", "id": 4, "method": ',
                '{"jsonrpc": "2.0", "id": {"a": 1}, "method": "tools/list"}',
                '{"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": {"x": '
                + "[" * 300
                + "]" * 300
                + "}}",
                '{"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"a": ' + "9" * 5000 + "}}",
                '{"jsonrpc": "2.0", "id": 9, "method": "ping", "params": {"x": "' + "a" * (17 << 20) + '"}}',
            )
        ]
        assert [(answer["id"], answer["error"]["code"]) for answer in refused] == [
            (None, types.PARSE_ERROR),
            (None, types.INVALID_REQUEST),
            (7, types.INVALID_REQUEST),
            (None, types.PARSE_ERROR),
            (None, types.PARSE_ERROR),
        ]
        pong = _rpc(process, '{"jsonrpc": "2.0", "id": 5, "method": "ping"}')
        assert pong == {"jsonrpc": "2.0", "id": 5, "result": {}}
        listed = _rpc(process, '{"jsonrpc": "2.0", "id": 6, "method": "tools/list"}')
        assert [t["name"] for t in listed["result"]["tools"]] == ["echo"]
        process.stdin.close()
        assert process.wait(timeout=20) == 0
        assert "Traceback" not in process.stderr.read()


@pytest.mark.parametrize("mode", ERAS)
async def test_a_cancelled_request_kills_its_sandbox_and_is_audited_as_cancelled(
    bench: ToolBench, mode: str, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("sleeper", SLEEPER, limits=SLOW)
    request_id = f"req_mcp_cancel_{mode}"
    async with Client(stdio_server(bench), mode=mode) as client:
        with anyio.move_on_after(1.5):
            await client.call_tool(
                "sleeper", {"seconds": 60}, meta=cast(types.RequestParamsMeta, {REQUEST_ID_META: request_id})
            )
        # The server is still there, and the sandbox is gone.
        assert not (await client.call_tool("sleeper", {"seconds": 0})).is_error
        no_survivors(request_id)
        [finished] = audit_events(bench, event="call.finished", requestId=request_id)
    assert finished["cancelled"] is True


async def test_a_call_longer_than_a_second_sends_progress_when_the_client_asks(bench: ToolBench) -> None:
    bench.tool("sleeper", SLEEPER, limits=SLOW)
    seen: list[float] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    async with Client(stdio_server(bench)) as client:
        await client.call_tool("sleeper", {"seconds": 0}, progress_callback=progress)
        assert seen == []  # a quick call: no progress
        result = await client.call_tool("sleeper", {"seconds": 2.5}, progress_callback=progress)
    assert not result.is_error
    assert len(seen) >= 2 and seen == sorted(seen)


@pytest.mark.parametrize("mode", ERAS)
async def test_sigterm_drains_the_call_in_flight_then_exits_zero(bench: ToolBench, mode: str) -> None:
    bench.tool("sleeper", SLEEPER, output_schema=OBJECT_OUT, limits=SLOW)
    exit_file = bench.root / "exit-status"
    results: list[types.CallToolResult] = []
    async with Client(stdio_server(bench, exit_file=exit_file), mode=mode) as client:
        await client.list_tools()  # the client checks structuredContent against the listing

        async def call() -> None:
            results.append(await client.call_tool("sleeper", {"seconds": 2}))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            await anyio.sleep(0.8)
            os.kill(server_pid(bench), signal.SIGTERM)
        for _ in range(100):
            if exit_file.exists() and exit_file.read_text():
                break
            await anyio.sleep(0.1)
    assert results[0].structured_content == {"slept": 2}
    assert exit_file.read_text().strip() == "0"


async def test_a_call_that_waits_for_a_slot_past_its_deadline_times_out_without_running(
    bench: ToolBench,
) -> None:
    bench.tool("holder", SLEEPER, limits=SLOW)
    bench.tool("quick", SLEEPER, limits={"timeout_ms": 1000, "deadline_ms": 1000})
    bench.policy["serve"] = {"max_concurrent": 1}
    async with Client(stdio_server(bench)) as client:
        results: dict[str, types.CallToolResult] = {}

        async def call(name: str, seconds: float) -> None:
            results[name] = await client.call_tool(name, {"seconds": seconds})

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call, "holder", 2.5)
            await anyio.sleep(0.5)
            tasks.start_soon(call, "quick", 0)
    assert not results["holder"].is_error
    assert results["quick"].is_error and text_of(results["quick"]).startswith("TIMEOUT: ")
    assert results["quick"].meta is not None
    assert results["quick"].meta[ERROR_META]["details"] == {"reason": "queued"}
    assert audit_events(bench, event="call.attempt", toolName="quick") == []  # it never ran
    [finished] = audit_events(bench, event="call.finished", toolName="quick")
    assert finished["reason"] == "queued"
