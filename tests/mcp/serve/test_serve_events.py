"""A tool's events through ``runner serve --stdio`` to the official MCP client: its
blocks after the result's text, its own progress instead of the heartbeat, its logs as
``notifications/message`` from the level the client set; schemas as written."""

from __future__ import annotations

import base64
import json
import warnings
from typing import Any

import anyio
import mcp_types as types
import pytest
from conftest import ToolBench
from mcp import Client
from mcp.shared.exceptions import MCPDeprecationWarning
from support.mcp_harness import stdio_server

pytestmark = pytest.mark.anyio

RICH = """
import time
import runner_tool as rt

def main(params, context):
    rt.progress(0, 2, "starting")
    rt.log("debug", "fine detail")
    rt.log("warning", {"disk": "low"})
    rt.text("see the picture")
    rt.image(b"PNGDATA", "image/png")
    rt.resource("file:///report.txt", text="report", mime_type="text/plain")
    time.sleep(params.get("seconds", 0))
    rt.progress(2, 2, "done")
    return {"ok": True}

rt.run(main)
"""
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {"name": {"type": "string", "minLength": 1}},
    "properties": {"who": {"$ref": "#/$defs/name"}, "seconds": {"type": "number"}},
}


async def settled(heard: list[Any], count: int) -> None:
    """The client hands notifications to its callback apart from the result: wait for
    ``count`` of them (bounded), and a moment for any more."""
    with anyio.move_on_after(5):
        while len(heard) < count:
            await anyio.sleep(0.02)
    await anyio.sleep(0.2)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def rich_bench(bench: ToolBench) -> ToolBench:
    bench.tool("rich", RICH, parameters=SCHEMA, limits={"timeout_ms": 20000})
    return bench


async def test_the_tools_blocks_follow_the_result_text(rich_bench: ToolBench) -> None:
    async with Client(stdio_server(rich_bench), mode="legacy") as client:
        result = await client.call_tool("rich", {})
    assert not result.is_error
    first, text, image, resource = result.content
    assert isinstance(first, types.TextContent) and json.loads(first.text) == {"ok": True}
    assert isinstance(text, types.TextContent) and text.text == "see the picture"
    assert isinstance(image, types.ImageContent) and image.mime_type == "image/png"
    assert base64.b64decode(image.data) == b"PNGDATA"
    assert isinstance(resource, types.EmbeddedResource)
    assert isinstance(resource.resource, types.TextResourceContents)
    assert resource.resource.text == "report"


async def test_the_tools_own_progress_replaces_the_heartbeat(rich_bench: ToolBench) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    async with Client(stdio_server(rich_bench), mode="legacy") as client:
        result = await client.call_tool("rich", {"seconds": 2.2}, progress_callback=progress)
    assert not result.is_error, result.content
    # The heartbeat may come while the sandbox starts (its steps are millionths); from the
    # tool's first progress on, over two seconds of its sleep, only the tool's own, as sent
    # (its 0 a step above a heartbeat's, if one came).
    ours = [index for index, (_, _, message) in enumerate(seen) if message == "starting"]
    (first, first_total, _), *rest = seen[ours[0] :]
    assert first < 1e-4 and first_total == 2
    assert rest == [(2, 2, "done")]
    assert [done for done, _, _ in seen] == sorted(done for done, _, _ in seen)


LATE = """
import time
import runner_tool as rt

def main(params, context):
    time.sleep(2.5)
    for quarter in range(1, 5):
        rt.progress(quarter / 4, 1, f"part {quarter}")
    return {"ok": True}

rt.run(main)
"""


async def test_a_tools_progress_after_heartbeats_goes_out_as_the_tool_sent_it(bench: ToolBench) -> None:
    # Fractions after two heartbeats (progress 1 and 2, in seconds) were all below them and
    # never went out.
    bench.tool("late", LATE, limits={"timeout_ms": 20000})
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    async with Client(stdio_server(bench), mode="legacy") as client:
        result = await client.call_tool("late", {}, progress_callback=progress)
        await settled(seen, 6)
    assert not result.is_error, result.content
    beats = [done for done, total, message in seen if message is not None and "running for" in message]
    tools = [entry for entry in seen if entry[2] is not None and entry[2].startswith("part")]
    assert len(beats) >= 2 and all(done < 1e-4 for done in beats), seen
    assert tools == [(quarter / 4, 1, f"part {quarter}") for quarter in range(1, 5)], seen


async def test_logs_go_out_from_the_level_the_client_set(rich_bench: ToolBench) -> None:
    heard: list[tuple[str, Any]] = []

    async def logged(params: types.LoggingMessageNotificationParams) -> None:
        heard.append((params.level, params.data))

    async with Client(stdio_server(rich_bench), mode="legacy", logging_callback=logged) as client:
        capabilities = client.server_capabilities
        assert capabilities is not None and capabilities.logging is not None
        await client.call_tool("rich", {})
        await settled(heard, 2)
        assert heard == [("debug", "fine detail"), ("warning", {"disk": "low"})]
        heard.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MCPDeprecationWarning)
            await client.set_logging_level("info")
        await client.call_tool("rich", {})
        await settled(heard, 1)
    assert heard == [("warning", {"disk": "low"})]


async def test_tools_list_keeps_the_schema_as_written(rich_bench: ToolBench) -> None:
    async with Client(stdio_server(rich_bench), mode="legacy") as client:
        [tool] = (await client.list_tools()).tools
    assert tool.input_schema == SCHEMA
