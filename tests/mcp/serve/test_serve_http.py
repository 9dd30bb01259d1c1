"""``runner serve --http``: streamable HTTP at /mcp behind bearer tokens, driven by the
official MCP client (SDK v2) against the real server process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from datetime import datetime, timedelta

import anyio
import httpx2
import mcp_types as types
import pytest
from conftest import ToolBench
from mcp import Client
from support.mcp_harness import ECHO, OBJECT_OUT, SLEEPER, SLOW, HttpServer, add_token, audit_events

from runner.mcp.serve.app import DURATION_META

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def served(bench: ToolBench) -> Iterator[tuple[HttpServer, dict[str, str]]]:
    bench.tool("echo", ECHO)
    bench.tool("sleeper", SLEEPER, output_schema=OBJECT_OUT, limits=SLOW)
    bench.policy["roles"] = {"user": {"allow": ["echo"]}, "admin": {"inherits": ["user"], "allow": ["*"]}}
    bench.policy["serve"] = {"max_concurrent": 3}
    tokens = {"ci-agent": add_token(bench, "ci-agent", "user"), "ops": add_token(bench, "ops", "admin")}
    server = HttpServer(bench)
    yield server, tokens
    assert server.stop() == 0


async def test_a_request_without_a_token_or_with_an_unknown_one_is_401_and_audited(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    server, tokens = served
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    async with httpx2.AsyncClient() as http:
        missing = await http.post(server.url, json=ping)
        unknown = await http.post(server.url, json=ping, headers={"Authorization": "Bearer rnr_guessed"})
        not_bearer = await http.post(
            server.url, json=ping, headers={"Authorization": f"Basic {tokens['ops']}"}
        )
    for answer in (missing, unknown, not_bearer):
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(Exception):  # noqa: B017 - the SDK wraps the 401 in its own error group
        async with server.client("rnr_guessed"):
            pass
    refused = audit_events(bench, event="serve.auth")
    assert {e["reason"] for e in refused} == {"missing_token", "unknown_token"}
    assert all(e["decision"] == "deny" and e["peer"].startswith("127.0.0.1:") for e in refused)
    assert not any(tokens["ops"] in line for line in bench.audit_log.read_text().splitlines())


async def test_a_forwarded_for_header_from_a_local_peer_is_not_its_address(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    # uvicorn believed X-Forwarded-For from loopback by default: any local user wrote the
    # peer of its own refusals (and the key of their budget), and a token client behind a
    # proxy that adds the header was never trusted by the connection gate.
    server, _ = served
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    forged = {"X-Forwarded-For": "203.0.113.66", "Forwarded": "for=203.0.113.67"}
    async with httpx2.AsyncClient() as http:
        answer = await http.post(server.url, json=ping, headers=forged)
    assert answer.status_code == 401
    [refused] = audit_events(bench, event="serve.auth")
    assert refused["peer"].startswith("127.0.0.1:"), refused
    assert "203.0.113" not in bench.audit_log.read_text()


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_each_token_gets_its_roles_tools_and_its_name_in_every_audit_event_of_its_calls(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]], mode: str
) -> None:
    server, tokens = served
    async with (
        server.client(tokens["ci-agent"], mode=mode) as user,
        server.client(tokens["ops"], mode=mode) as ops,
    ):
        assert [t.name for t in (await user.list_tools()).tools] == ["echo"]
        assert [t.name for t in (await ops.list_tools()).tools] == ["echo", "sleeper"]
        denied = await user.call_tool("sleeper", {"seconds": 0})
        slept = await ops.call_tool("sleeper", {"seconds": 0})
    assert denied.is_error and isinstance(denied.content[0], types.TextContent)
    assert denied.content[0].text.startswith("PERMISSION_DENIED: ")
    assert slept.structured_content == {"slept": 0}
    calls = [e for e in audit_events(bench) if e.get("toolName") == "sleeper"]
    assert {e["event"] for e in calls} >= {"policy.decision", "call.attempt", "call.finished"}
    by_client = {(e["client"], e["role"]) for e in calls}
    assert by_client == {("ci-agent", "user"), ("ops", "admin")}


async def test_fifty_concurrent_calls_from_two_clients_are_all_answered_within_max_concurrent(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    server, tokens = served
    answers: dict[tuple[str, int], object] = {}

    async def call(client_name: str, client: Client, n: int) -> None:
        result = await client.call_tool("sleeper", {"seconds": 0.1, "n": n})
        assert not result.is_error, result.content
        answers[(client_name, n)] = result.structured_content

    async with (
        server.client(tokens["ops"]) as first,
        server.client(tokens["ops"], mode="legacy") as second,
        anyio.create_task_group() as tasks,
    ):
        for n in range(25):
            tasks.start_soon(call, "first", first, n)
            tasks.start_soon(call, "second", second, n)
    assert len(answers) == 50
    assert all(value == {"slept": 0.1} for value in answers.values())
    # serve.max_concurrent = 3: at no moment did more than 3 attempts run at once.
    attempts = audit_events(bench, event="call.attempt", toolName="sleeper")
    assert len(attempts) == 50
    spans = []
    for event in attempts:
        end = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
        spans.append((end - timedelta(milliseconds=event["duration"]), end))
    starts = [start for start, _ in spans]
    most = max(sum(1 for s, e in spans if s < at < e) + 1 for at in starts)
    assert most <= 3


async def test_sigterm_lets_the_call_in_flight_finish_and_exits_zero(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    server, tokens = served
    async with server.client(tokens["ops"]) as client:
        await client.list_tools()
        async with anyio.create_task_group() as tasks:
            done: list[types.CallToolResult] = []

            async def call() -> None:
                done.append(await client.call_tool("sleeper", {"seconds": 2}))

            tasks.start_soon(call)
            await anyio.sleep(0.8)
            server.process.terminate()
        assert done[0].structured_content == {"slept": 2}
    assert server.stop() == 0
    assert "Traceback" not in "".join(server.stderr)


async def test_the_protocol_adds_milliseconds_not_a_delayed_ack_to_each_call(
    served: tuple[HttpServer, dict[str, str]],
) -> None:
    server, tokens = served
    overheads = []
    async with server.client(tokens["ops"]) as client:
        await client.list_tools()
        for _ in range(12):
            started = time.perf_counter()
            result = await client.call_tool("echo", {"n": 1})
            trip_ms = (time.perf_counter() - started) * 1000
            assert result.meta is not None
            overheads.append(trip_ms - result.meta[DURATION_META])
    # Without TCP_NODELAY, Nagle's algorithm and the client's delayed ACK add ~40 ms to
    # every answer; bench/serve_call.py measures ~5 ms here.
    assert statistics.median(overheads) < 25
