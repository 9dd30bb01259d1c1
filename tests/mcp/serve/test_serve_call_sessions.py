"""Sessions through ``runner serve``: each MCP client session has its own session
sandboxes, which end with it; two clients never share one; ``session.max_per_token``
holds per token. The real server process and the SDK's real client."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from conftest import ToolBench, wait_for
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent
from support.mcp_harness import HttpServer, add_token, audit_events, stdio_server

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="the hardened sandbox runs as root here"),
]

COUNTER = """
import json, os, sys
json.load(sys.stdin)
path = "/tmp/count"
count = int(open(path).read()) if os.path.exists(path) else 0
open(path, "w").write(str(count + 1))
print(json.dumps({"count": count + 1}))
"""

STATEFUL_SERVER = Path(__file__).resolve().parents[2] / "support" / "servers" / "stateful_mcp.py"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _text(answer: Any) -> str:
    content = answer.content[0]
    assert isinstance(content, TextContent)
    return content.text


def _count(answer: Any) -> int:
    assert not answer.is_error, answer.content
    return int(json.loads(_text(answer))["count"])


@pytest.fixture
def counter(bench: ToolBench) -> ToolBench:
    bench.tool("counter", COUNTER, session=True)
    bench.policy["roles"] = {"user": {"allow": ["counter"]}}
    return bench


async def test_two_tokens_and_two_sessions_of_one_token_never_share_state(counter: ToolBench) -> None:
    tokens = {name: add_token(counter, name, "user") for name in ("alice", "bob")}
    server = HttpServer(counter)
    try:
        async with (
            server.client(tokens["alice"], mode="legacy") as alice,
            server.client(tokens["bob"], mode="legacy") as bob,
        ):
            assert [_count(await alice.call_tool("counter", {})) for _ in range(3)] == [1, 2, 3]
            assert _count(await bob.call_tool("counter", {})) == 1
            async with server.client(tokens["alice"], mode="legacy") as alice_again:
                assert _count(await alice_again.call_tool("counter", {})) == 1
            # That client's end (its DELETE) ended its session, sandbox and all.
            wait_for(lambda: len(audit_events(counter, event="session.closed")) == 1, 10)
            assert _count(await alice.call_tool("counter", {})) == 4
            assert _count(await bob.call_tool("counter", {})) == 2
        wait_for(lambda: len(audit_events(counter, event="session.closed")) == 3, 10)
    finally:
        assert server.stop() == 0
    opened = audit_events(counter, event="session.opened")
    assert sorted(event["client"] for event in opened) == ["alice", "alice", "bob"]
    assert len({event["sessionId"] for event in opened}) == 3
    closed = audit_events(counter, event="session.closed")
    assert {event["reason"] for event in closed} == {"ended"}
    by_session = {event["sessionId"]: event["calls"] for event in closed}
    assert sorted(by_session.values()) == [1, 2, 4]
    for event in audit_events(counter, event="call.finished"):
        assert event["sessionId"] in by_session


async def test_a_token_at_its_max_per_token_is_refused_another_session_sandbox(counter: ToolBench) -> None:
    counter.policy["session"] = {"max_per_token": 1}
    tokens = {name: add_token(counter, name, "user") for name in ("alice", "bob")}
    server = HttpServer(counter)
    try:
        async with (
            server.client(tokens["alice"], mode="legacy") as first,
            server.client(tokens["alice"], mode="legacy") as second,
        ):
            assert _count(await first.call_tool("counter", {})) == 1
            refused = await second.call_tool("counter", {})
            assert refused.is_error
            assert _text(refused).startswith("EXECUTION_ERROR")
            assert "max_per_token" in _text(refused)
            async with server.client(tokens["bob"], mode="legacy") as bob:
                assert _count(await bob.call_tool("counter", {})) == 1
    finally:
        assert server.stop() == 0


async def test_a_2026_client_over_http_has_no_session_so_each_call_is_fresh(counter: ToolBench) -> None:
    token = add_token(counter, "alice", "user")
    server = HttpServer(counter)
    try:
        async with server.client(token) as client:  # the 2026-07-28 protocol: no MCP session
            assert [_count(await client.call_tool("counter", {})) for _ in range(2)] == [1, 1]
    finally:
        assert server.stop() == 0
    assert audit_events(counter, event="session.opened") == []


async def test_a_2026_client_cannot_make_a_session_by_sending_a_session_header(counter: ToolBench) -> None:
    # The SDK checks no session header of a 2026-07-28 request: one a client sends is not
    # a session (else any client could open unbounded sessions outside every cap).
    token = add_token(counter, "alice", "user")
    server = HttpServer(counter)
    headers = {"Authorization": f"Bearer {token}", "Mcp-Session-Id": "made-up-by-the-client"}
    try:
        async with (
            httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60.0)) as http,
            Client(streamable_http_client(server.url, http_client=http)) as client,
        ):
            assert [_count(await client.call_tool("counter", {})) for _ in range(2)] == [1, 1]
    finally:
        assert server.stop() == 0
    assert audit_events(counter, event="session.opened") == []


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_stdio_connection_is_one_session_ended_with_it(counter: ToolBench, mode: str) -> None:
    async with Client(stdio_server(counter), mode=mode) as client:
        assert [_count(await client.call_tool("counter", {})) for _ in range(2)] == [1, 2]
    closed = audit_events(counter, event="session.closed")
    assert [(event["reason"], event["calls"]) for event in closed] == [("ended", 2)]


async def test_a_hosted_session_server_is_one_per_client_session_over_http(bench: ToolBench) -> None:
    server_folder = bench.tools / "st"
    server_folder.mkdir()
    shutil.copy(STATEFUL_SERVER, server_folder / "server.py")
    manifest = {"name": "st", "kind": "mcp", "command": ["python3", "server.py"], "session": True}
    (server_folder / "tool.yaml").write_text(yaml.safe_dump(manifest))
    bench.policy["roles"] = {"user": {"allow": ["st_count"]}}
    tokens = {name: add_token(bench, name, "user") for name in ("alice", "bob")}
    server = HttpServer(bench)

    def seen(answer: Any) -> int:
        assert not answer.is_error, answer.content
        return int(json.loads(json.loads(_text(answer)))["count"])  # the server's text, as JSON

    try:
        async with (
            server.client(tokens["alice"], mode="legacy") as alice,
            server.client(tokens["bob"], mode="legacy") as bob,
        ):
            assert [seen(await alice.call_tool("st_count", {})) for _ in range(3)] == [1, 2, 3]
            assert [seen(await bob.call_tool("st_count", {})) for _ in range(2)] == [1, 2]
            assert seen(await alice.call_tool("st_count", {})) == 4
        wait_for(lambda: len(audit_events(bench, event="session.closed")) == 2, 10)
    finally:
        assert server.stop() == 0
    opened = audit_events(bench, event="session.opened")
    assert sorted((event["client"], event["toolName"]) for event in opened) == [
        ("alice", "st"),
        ("bob", "st"),
    ]
