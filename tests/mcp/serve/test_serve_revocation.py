"""Revocation fails closed: a token removed from the policy file stops working at the next
reload even when the same edit is refused for something else, and a file that cannot be
read at all stops every token until one that loads is back; its open sessions and event
streams end. Real server process, httpx and the SDK's client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
import yaml
from conftest import ToolBench
from support.mcp_harness import ECHO, HttpServer, add_token, audit_events, write_policy
from support.mcp_raw import headers, initialize, jsonrpc_error, open_session

from runner.mcp.serve.auth import new_token, token_digest
from runner.mcp.serve.reload import tokens_in_file

pytestmark = pytest.mark.anyio
RELOADED_WITHIN_S = 20  # the server looks every 0.5 s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def served(bench: ToolBench) -> Iterator[tuple[HttpServer, dict[str, str]]]:
    bench.tool("echo", ECHO)
    bench.policy["roles"] = {"user": {"allow": ["echo"]}}
    tokens = {name: add_token(bench, name, "user") for name in ("alice", "mallory")}
    server = HttpServer(bench)
    yield server, tokens
    assert server.stop() == 0


async def status(url: str, token: str) -> int:
    """How the server answers ``token``'s request to open a session."""
    async with httpx2.AsyncClient(timeout=30) as http:
        answer = await initialize(http, url, token)
    if answer.status_code == 401:
        assert "unauthorized" in jsonrpc_error(answer)["message"]
    return answer.status_code


async def reloaded(bench: ToolBench, count: int, **match: Any) -> None:
    with anyio.fail_after(RELOADED_WITHIN_S):
        while len(audit_events(bench, event="serve.reload", **match)) < count:
            await anyio.sleep(0.1)


def without(bench: ToolBench, name: str) -> dict[str, Any]:
    policy = yaml.safe_load(yaml.safe_dump(bench.policy))
    policy["serve"]["tokens"] = [entry for entry in policy["serve"]["tokens"] if entry["name"] != name]
    return dict(policy)


async def test_a_token_removed_in_an_edit_that_is_refused_stops_working_and_the_rest_of_the_edit_waits(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    server, tokens = served
    assert await status(server.url, tokens["alice"]) == 200
    assert await status(server.url, tokens["mallory"]) == 200
    newbie = new_token()
    edit = without(bench, "mallory")
    edit["serve"]["tokens"].append({"name": "newbie", "sha256": token_digest(newbie), "role": "user"})
    edit["roles"]["user"]["allow"] = "echo"  # the unrelated mistake: not a list
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(edit))
    await reloaded(bench, 1, accepted=False)

    assert await status(server.url, tokens["mallory"]) == 401  # revoked at once
    assert await status(server.url, newbie) == 401  # an addition waits for a policy that loads
    async with server.client(tokens["alice"]) as client:  # the old policy still rules the rest
        assert [tool.name for tool in (await client.list_tools()).tools] == ["echo"]
    [revoked] = audit_events(bench, event="serve.revoke")
    assert (
        revoked["tokens"] == ["mallory"] and revoked["accepted"] is False and revoked["reason"] == "removed"
    )

    edit["roles"]["user"]["allow"] = ["echo"]  # fixed: now the whole edit is taken
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(edit))
    await reloaded(bench, 1, accepted=True)
    assert await status(server.url, newbie) == 200
    assert await status(server.url, tokens["mallory"]) == 401
    assert await status(server.url, tokens["alice"]) == 200
    assert server.stop() == 0
    assert "revokes" in "".join(server.stderr) and "mallory" in "".join(server.stderr)


async def test_a_policy_file_that_cannot_be_parsed_stops_every_token_until_one_that_loads_is_back(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    server, tokens = served
    assert await status(server.url, tokens["alice"]) == 200
    (bench.root / "policies.yaml").write_text("version: 1\nserve: {tokens: [\n")  # not YAML
    await reloaded(bench, 1, accepted=False)
    assert await status(server.url, tokens["alice"]) == 401
    assert await status(server.url, tokens["mallory"]) == 401
    [revoked] = audit_events(bench, event="serve.revoke")
    assert sorted(revoked["tokens"]) == ["alice", "mallory"] and revoked["reason"] == "unreadable_policy"

    write_policy(bench)  # the file as it was: both tokens back
    await reloaded(bench, 1, accepted=True)
    assert await status(server.url, tokens["alice"]) == 200
    assert await status(server.url, tokens["mallory"]) == 200


async def test_a_revoked_tokens_open_event_stream_and_session_end(
    bench: ToolBench, served: tuple[HttpServer, dict[str, str]]
) -> None:
    server, tokens = served
    mallory = tokens["mallory"]
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(60.0)) as http:
        session = await open_session(http, server.url, mallory)
        async with http.stream("GET", server.url, headers=headers(mallory, session)) as stream:
            assert stream.status_code == 200
            (bench.root / "policies.yaml").write_text(yaml.safe_dump(without(bench, "mallory")))
            with anyio.fail_after(RELOADED_WITHIN_S):  # the stream ends: the server closed it
                async for _ in stream.aiter_bytes():
                    pass
    [ended] = audit_events(bench, event="serve.session", reason="token_revoked")
    assert ended["count"] == 1
    [revoked] = audit_events(bench, event="serve.revoke")
    assert revoked["tokens"] == ["mallory"] and revoked["accepted"] is True
    assert await status(server.url, tokens["alice"]) == 200


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("version: 1\n", set()),  # no serve.tokens: none kept
        ("version: 1\nserve: {tokens: [{sha256: abc}, {name: x}, 5, {sha256: 7}]}\nroles: 3\n", {"abc"}),
        ("version: 1\nserve: {tokens: {a: 1}}\n", None),
        ("version: 1\nserve: [1]\n", None),
        ("- 1\n", None),
        ("version: 1\nserve: {tokens: [\n", None),
        ("", None),
    ],
)
def test_a_refused_files_token_list_is_read_leniently_or_not_at_all(
    tmp_path: Path, text: str, kept: set[str] | None
) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(text)
    assert tokens_in_file(policy) == kept
    assert tokens_in_file(tmp_path / "missing.yaml") is None
