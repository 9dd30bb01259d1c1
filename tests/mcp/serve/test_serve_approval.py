"""Approval over MCP: ``runner serve`` asks the calling client with ``elicitation/create``,
driven by the official MCP client (SDK v2) against the real server process, over stdio and
over HTTP with a token."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anyio
import mcp_types as types
import pytest
from conftest import ToolBench
from mcp import Client, ClientSession
from mcp.client.context import ClientRequestContext
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from support.mcp_harness import ECHO, HttpServer, add_token, audit_events, stdio_server

from runner.call.approval import ApprovalUnavailable
from runner.mcp.serve.approval import SpentAnswers

pytestmark = pytest.mark.anyio
# auto: 2026-07-28, asked with an input_required answer the client calls again after;
# legacy: the 2025-11-25 handshake, asked with a request on the call's own channel.
ERAS = ["auto", "legacy"]
SECRET_PARAMS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "token": {"type": "string", "x-sensitive": True}},
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def held(bench: ToolBench) -> ToolBench:
    bench.tool("wipe", ECHO, tags=["destructive"], parameters=SECRET_PARAMS)
    bench.policy["roles"] = {"user": {"allow": ["*"]}}
    bench.policy["approval"] = {"tools": ["tag:destructive"], "timeout_ms": 5000}
    return bench


class Person:
    """An elicitation callback that answers ``answer`` after ``delay`` s and keeps what it was asked."""

    def __init__(self, answer: types.ElicitResult | None, delay: float = 0.0) -> None:
        self.answer = answer
        self.delay = delay
        self.asked: list[types.ElicitRequestParams] = []

    async def __call__(
        self, context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        self.asked.append(params)
        await anyio.sleep(self.delay)
        if self.answer is None:
            await anyio.sleep(3600)
        assert self.answer is not None
        return self.answer


YES = types.ElicitResult(action="accept", content={"approve": True})


def text_of(result: types.CallToolResult) -> str:
    [content] = result.content
    assert isinstance(content, types.TextContent)
    return content.text


def error_of(result: types.CallToolResult) -> dict[str, Any]:
    assert result.is_error
    assert result.meta is not None
    error: dict[str, Any] = result.meta["dev.runner/error"]
    return error


@pytest.mark.parametrize("mode", ERAS)
async def test_an_accepted_elicitation_runs_the_call_and_the_question_hides_sensitive_params(
    held: ToolBench, mode: str
) -> None:
    person = Person(YES)
    async with Client(stdio_server(held), mode=mode, elicitation_callback=person) as client:
        result = await client.call_tool("wipe", {"path": "/data", "token": "hunter2-secret"})
    assert not result.is_error, text_of(result)
    assert json.loads(text_of(result)) == {"path": "/data", "token": "hunter2-secret"}
    [asked] = person.asked
    assert isinstance(asked, types.ElicitRequestFormParams)
    assert "wipe" in asked.message and "/data" in asked.message and "***" in asked.message
    assert "hunter2-secret" not in asked.message
    assert asked.requested_schema["properties"]["approve"]["type"] == "boolean"
    [approval] = audit_events(held, event="call.approval")
    assert approval["decision"] == "approved" and approval["by"] == "stdio"


@pytest.mark.parametrize("mode", ERAS)
@pytest.mark.parametrize(
    ("answer", "decision"),
    [
        (types.ElicitResult(action="decline"), "declined"),
        (types.ElicitResult(action="cancel"), "declined"),
        (types.ElicitResult(action="accept", content={"approve": False}), "declined"),
    ],
)
async def test_a_decline_a_cancel_or_an_accepted_no_is_not_approved(
    held: ToolBench, answer: types.ElicitResult, decision: str, mode: str
) -> None:
    async with Client(stdio_server(held), mode=mode, elicitation_callback=Person(answer)) as client:
        result = await client.call_tool("wipe", {"path": "/data"})
    error = error_of(result)
    assert error["code"] == "PERMISSION_DENIED" and error["details"]["reason"] == "not_approved"
    assert [e["decision"] for e in audit_events(held, event="call.approval")] == [decision]
    assert audit_events(held, event="call.attempt") == []


@pytest.mark.parametrize(
    ("mode", "person"),
    [
        ("legacy", Person(None)),  # the server stops waiting
        ("auto", Person(YES, delay=1.0)),  # the yes comes back too late
    ],
)
async def test_no_answer_within_timeout_ms_is_not_approved(
    held: ToolBench, mode: str, person: Person
) -> None:
    held.policy["approval"]["timeout_ms"] = 500
    async with Client(stdio_server(held), mode=mode, elicitation_callback=person) as client:
        result = await client.call_tool("wipe", {"path": "/data"})
    assert error_of(result)["details"]["reason"] == "not_approved"
    [approval] = audit_events(held, event="call.approval")
    assert approval["decision"] == "timeout"
    assert audit_events(held, event="call.attempt") == []


@pytest.mark.parametrize("mode", ERAS)
async def test_a_client_without_the_elicitation_capability_gets_approval_unavailable(
    held: ToolBench, mode: str
) -> None:
    async with Client(stdio_server(held), mode=mode) as client:
        result = await client.call_tool("wipe", {"path": "/data"})
    error = error_of(result)
    assert error["code"] == "PERMISSION_DENIED" and error["details"]["reason"] == "approval_unavailable"
    [approval] = audit_events(held, event="call.approval")
    assert approval["decision"] == "unavailable" and approval["by"] == "stdio"


@pytest.mark.parametrize("mode", ERAS)
async def test_the_wait_for_the_answer_does_not_count_against_the_deadline(
    held: ToolBench, mode: str
) -> None:
    held.policy["defaults"]["deadline_ms"] = 1000
    async with Client(stdio_server(held), mode=mode, elicitation_callback=Person(YES, delay=1.5)) as client:
        result = await client.call_tool("wipe", {"path": "/data"})
    assert not result.is_error, text_of(result)
    [approval] = audit_events(held, event="call.approval")
    assert approval["decision"] == "approved" and approval["waitedMs"] >= 1500


@pytest.fixture
def over_http(held: ToolBench) -> Iterator[tuple[HttpServer, str]]:
    token = add_token(held, "ci-agent", "user")
    server = HttpServer(held)
    yield server, token
    assert server.stop() == 0


@pytest.mark.parametrize("mode", ERAS)
async def test_over_http_the_client_of_the_token_is_asked_and_named_in_the_audit_event(
    held: ToolBench, over_http: tuple[HttpServer, str], mode: str
) -> None:
    server, token = over_http
    person = Person(YES)
    async with server.client(token, mode=mode, elicitation_callback=person) as client:
        result = await client.call_tool("wipe", {"path": "/data"})
    assert not result.is_error, text_of(result)
    assert len(person.asked) == 1
    [approval] = audit_events(held, event="call.approval")
    assert approval["decision"] == "approved" and approval["by"] == "ci-agent"


@pytest.mark.parametrize("mode", ERAS)
async def test_over_http_a_client_without_the_elicitation_capability_gets_approval_unavailable(
    held: ToolBench, over_http: tuple[HttpServer, str], mode: str
) -> None:
    server, token = over_http
    async with server.client(token, mode=mode) as client:
        result = await client.call_tool("wipe", {"path": "/data"})
    assert error_of(result)["details"]["reason"] == "approval_unavailable"
    [approval] = audit_events(held, event="call.approval")
    assert approval["decision"] == "unavailable" and approval["by"] == "ci-agent"


async def test_a_call_refused_by_the_policy_or_with_bad_params_is_never_asked_about(held: ToolBench) -> None:
    held.policy["roles"]["user"]["deny"] = ["wipe"]
    person = Person(YES)
    async with Client(stdio_server(held), elicitation_callback=person) as client:
        denied = await client.call_tool("wipe", {"path": "/data"})
    assert error_of(denied)["details"]["reason"] == "denied_by_role"
    held.policy["roles"]["user"]["deny"] = []
    async with Client(stdio_server(held), elicitation_callback=person) as client:
        invalid = await client.call_tool("wipe", {"path": 5})
    assert error_of(invalid)["code"] == "INVALID_PARAMS"
    assert person.asked == []


async def test_a_2026_client_cannot_forge_move_or_replay_an_approval(held: ToolBench) -> None:
    """The answer only counts with the sealed requestState of its own question, once: a
    forged state, an answer without one, a state moved to other arguments, or an answer
    used already never runs the call."""
    yes: types.InputResponses = {"dev.runner/approval": YES}
    async with Client(stdio_server(held), mode="auto", elicitation_callback=Person(YES)) as client:
        session = client.session
        unasked = await session.call_tool(
            "wipe", {"path": "/a"}, input_responses=yes, allow_input_required=True
        )
        assert isinstance(unasked, types.InputRequiredResult)  # asked, not run
        assert unasked.request_state is not None and "wipe" not in unasked.request_state  # sealed
        forged = json.dumps({"tool": "wipe", "asked": 1e12, "timeoutMs": 5000})
        with pytest.raises(MCPError):
            await session.call_tool("wipe", {"path": "/a"}, input_responses=yes, request_state=forged)
        with pytest.raises(MCPError):  # the state of /a's question, for /b
            await session.call_tool(
                "wipe", {"path": "/b"}, input_responses=yes, request_state=unasked.request_state
            )
        allowed = await session.call_tool(
            "wipe", {"path": "/a"}, input_responses=yes, request_state=unasked.request_state
        )
        # One yes runs one call: the same answer sent again ran the call again, each time.
        replayed = [
            await session.call_tool(
                "wipe", {"path": "/a"}, input_responses=yes, request_state=unasked.request_state
            )
            for _ in range(2)
        ]
    assert isinstance(allowed, types.CallToolResult) and not allowed.is_error
    for again in replayed:
        assert isinstance(again, types.CallToolResult)
        assert error_of(again)["details"]["reason"] == "not_approved"
    assert [e["decision"] for e in audit_events(held, event="call.approval")] == [
        "approved",
        "declined",
        "declined",
    ]
    assert len(audit_events(held, event="call.attempt")) == 1


async def test_a_bare_client_session_with_an_elicitation_callback_is_asked(held: ToolBench) -> None:
    """The SDK's lower-level ``ClientSession`` (the 2025-11-25 handshake), as an agent
    framework built on it would hold one."""
    person = Person(types.ElicitResult(action="decline"))
    async with (
        stdio_client(stdio_server(held)) as (read, write),
        ClientSession(read, write, elicitation_callback=person) as session,
    ):
        await session.initialize()
        declined = await session.call_tool("wipe", {"path": "/data"})
        person.answer = YES
        approved = await session.call_tool("wipe", {"path": "/data"})
    assert (
        isinstance(declined, types.CallToolResult)
        and error_of(declined)["details"]["reason"] == "not_approved"
    )
    assert isinstance(approved, types.CallToolResult) and not approved.is_error
    assert len(person.asked) == 2
    assert [e["decision"] for e in audit_events(held, event="call.approval")] == ["declined", "approved"]


def test_a_yes_is_kept_as_used_until_its_timeout_and_one_client_cannot_fill_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spent = SpentAnswers()
    now = time.time()
    assert spent.spend("a", now + 0.05, "one") and not spent.spend("a", now + 0.05, "one")
    time.sleep(0.1)
    assert spent.spend("a", now + 60, "one")  # the first use expired with its question
    monkeypatch.setattr("runner.mcp.serve.approval.MAX_SPENT_PER_CLIENT", 2)
    assert spent.spend("b", now + 60, "one")
    with pytest.raises(ApprovalUnavailable):  # never a no that reads as a person's
        spent.spend("c", now + 60, "one")
    assert spent.spend("c", now + 60, "another")  # one client's table is its own
