"""``runner serve --http``: an MCP session belongs to the token that opened it, and one
token can hold only so many (``serve.max_sessions_per_token``), idle ones expiring
(``serve.session_idle_ms``). Hostile clients (httpx, the SDK's client) against the real
server process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2
import pytest
import yaml
from conftest import ToolBench
from support.mcp_harness import ECHO, HttpServer, add_token, audit_events
from support.mcp_raw import SESSION, headers, initialize, jsonrpc_error, list_tools, message, open_session

from runner.call.policy import Policy
from runner.errors import ConfigError

pytestmark = pytest.mark.anyio
DEFAULT_CAP = 16  # serve.max_sessions_per_token when the policy does not say


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def serve(bench: ToolBench, **settings: int) -> tuple[HttpServer, dict[str, str]]:
    bench.tool("echo", ECHO)
    bench.policy["roles"] = {"user": {"allow": ["echo"]}}
    if settings:
        bench.policy["serve"] = dict(settings)
    tokens = {name: add_token(bench, name, "user") for name in ("alice", "mallory")}
    return HttpServer(bench), tokens


@pytest.fixture
def served(bench: ToolBench) -> Iterator[tuple[HttpServer, dict[str, str]]]:
    server, tokens = serve(bench)
    yield server, tokens
    assert server.stop() == 0


def error_texts(error: BaseException) -> Iterator[str]:
    """The messages of ``error`` and of every exception in it (groups, causes)."""
    yield str(error)
    for inner in (*getattr(error, "exceptions", ()), error.__cause__):
        if inner is not None:
            yield from error_texts(inner)


def tool_names(answer: httpx2.Response) -> list[str]:
    return [tool["name"] for tool in message(answer)["result"]["tools"]]


async def test_another_token_gets_404_for_a_session_it_did_not_open_get_post_and_delete(
    served: tuple[HttpServer, dict[str, str]],
) -> None:
    server, tokens = served
    alice, mallory = tokens["alice"], tokens["mallory"]
    async with httpx2.AsyncClient(timeout=30) as http:
        session = await open_session(http, server.url, alice)
        listed = await list_tools(http, server.url, mallory, session)
        async with http.stream("GET", server.url, headers=headers(mallory, session)) as streamed:
            stream_status = streamed.status_code  # headers only: an open stream would not end
        deleted = await http.delete(server.url, headers=headers(mallory, session))
        assert (listed.status_code, stream_status, deleted.status_code) == (404, 404, 404)
        assert "tools" not in listed.text
        # Alice's session is untouched by all that, and hers alone to end.
        mine = await list_tools(http, server.url, alice, session)
        assert mine.status_code == 200 and tool_names(mine) == ["echo"]
        assert (await http.delete(server.url, headers=headers(alice, session))).status_code == 200
        assert (await list_tools(http, server.url, alice, session)).status_code == 404


async def test_one_token_opening_sessions_in_a_loop_gets_429_past_its_cap_and_another_token_still_gets_in(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    server, tokens = served
    alice, mallory = tokens["alice"], tokens["mallory"]
    async with httpx2.AsyncClient(timeout=30, limits=httpx2.Limits(max_connections=20)) as http:
        answers: list[httpx2.Response] = []

        async def open_one() -> None:
            answers.append(await initialize(http, server.url, mallory))

        async with anyio.create_task_group() as tasks:  # at once: the cap holds under a race too
            for _ in range(100):
                tasks.start_soon(open_one)
        opened = [a for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code != 200]
        assert len(opened) == DEFAULT_CAP
        assert {a.status_code for a in refused} == {429}
        error = jsonrpc_error(refused[0])
        assert "serve.max_sessions_per_token" in error["message"] and "16" in error["message"]

        # The SDK's client shows why it cannot connect.
        with pytest.raises(Exception) as failed:  # the SDK wraps it in a group; its leaves are checked
            async with server.client(mallory, mode="legacy"):
                pass
        assert any("serve.max_sessions_per_token" in text for text in error_texts(failed.value))

        # Alice is not locked out: the SDK's client connects and lists.
        async with server.client(alice, mode="legacy") as client:
            assert [tool.name for tool in (await client.list_tools()).tools] == ["echo"]

        # Ending one of mallory's sessions makes room for one more, not two.
        ended = await http.delete(server.url, headers=headers(mallory, opened[0].headers[SESSION]))
        assert ended.status_code == 200
        assert (await initialize(http, server.url, mallory)).status_code == 200
        assert (await initialize(http, server.url, mallory)).status_code == 429
    capped = audit_events(bench, event="serve.session", reason="session_cap")
    assert capped and all(e["client"] == "mallory" and e["decision"] == "deny" for e in capped)
    assert len(capped) <= 11  # a budget, not an event per refusal


async def test_a_configured_cap_holds_and_an_idle_session_expires_and_frees_its_place(
    bench: ToolBench,
) -> None:
    server, tokens = serve(bench, max_sessions_per_token=2, session_idle_ms=1500)
    mallory = tokens["mallory"]
    try:
        async with httpx2.AsyncClient(timeout=30) as http:
            idle = await open_session(http, server.url, mallory)
            busy = await open_session(http, server.url, mallory)
            assert (await initialize(http, server.url, mallory)).status_code == 429
            # ``busy`` is asked something every 0.3 s, ``idle`` nothing, for twice the idle time.
            until = time.monotonic() + 3.0
            while time.monotonic() < until:
                assert (await list_tools(http, server.url, mallory, busy)).status_code == 200
                await anyio.sleep(0.3)
            assert (await list_tools(http, server.url, mallory, idle)).status_code == 404
            await open_session(http, server.url, mallory)  # the expired session's place is free
            assert (await initialize(http, server.url, mallory)).status_code == 429
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "serve",
    [
        {"max_sessions_per_token": 0},
        {"max_sessions_per_token": -1},
        {"max_sessions_per_token": "many"},
        {"session_idle_ms": 0},
        {"session_idle_ms": 10},
        {"session_idle_ms": 10**12},
    ],
)
def test_bad_session_settings_are_refused_with_the_setting_named(
    tmp_path: Path, serve: dict[str, object]
) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(yaml.safe_dump({"version": 1, "serve": serve}))
    with pytest.raises(ConfigError) as refused:
        Policy.load(policy)
    assert f"serve.{next(iter(serve))}" in str(refused.value)


async def test_a_second_request_with_the_id_of_one_in_flight_is_refused_and_the_first_still_answered(
    bench: ToolBench,
) -> None:
    # The SDK keeps one answer stream per request id: the second took over the first's,
    # which then was never answered and held its (trusted, busy) connection open for good.
    bench.tool(
        "sleepy", "import json, sys, time\nsys.stdin.read()\ntime.sleep(4)\nprint(json.dumps({'slept': 4}))"
    )
    bench.policy["roles"] = {"user": {"allow": ["sleepy"]}}
    alice, mallory = add_token(bench, "alice", "user"), add_token(bench, "mallory", "user")
    server = HttpServer(bench)
    request = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "sleepy", "arguments": {}},
    }
    answers: dict[str, httpx2.Response] = {}
    try:
        async with httpx2.AsyncClient(timeout=30) as http:
            session = await open_session(http, server.url, alice)

            async def post(name: str, token: str = alice) -> None:
                answers[name] = await http.post(server.url, json=request, headers=headers(token, session))

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(post, "first")
                    await anyio.sleep(1.5)  # it has arrived (and its tool runs for 4 s)
                    tasks.start_soon(post, "second")
                    tasks.start_soon(post, "mallory", mallory)  # not hers: not even its ids are told
            again = await http.post(server.url, json=request, headers=headers(alice, session))
    finally:
        assert server.stop() == 0
    assert answers["mallory"].status_code == 404
    assert answers["second"].status_code == 409
    assert "already in flight" in jsonrpc_error(answers["second"])["message"]
    first = message(answers["first"])
    assert first["id"] == 7 and "slept" in first["result"]["content"][0]["text"], first
    assert again.status_code == 200 and message(again)["id"] == 7  # once answered, the id is free
