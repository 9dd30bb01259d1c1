"""MCP over plain HTTP (httpx), for the tests that need what the SDK's client hides: a
session's id, another token on the same session, a refused answer's status and body."""

from __future__ import annotations

import json
from typing import Any

import httpx2

PROTOCOL = "2025-11-25"  # a handshake-era version: the server keeps a session for it
ACCEPT = "application/json, text/event-stream"
SESSION = "mcp-session-id"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": PROTOCOL,
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"},
    },
}


def headers(token: str | None, session: str | None = None) -> dict[str, str]:
    out = {"Accept": ACCEPT}
    if token is not None:
        out["Authorization"] = f"Bearer {token}"
    if session is not None:
        out[SESSION] = session
        out["mcp-protocol-version"] = PROTOCOL
    return out


async def initialize(http: httpx2.AsyncClient, url: str, token: str) -> httpx2.Response:
    """The request that opens a session (answered, the session id in its headers, or refused)."""
    return await http.post(url, json=INITIALIZE, headers=headers(token))


async def open_session(http: httpx2.AsyncClient, url: str, token: str) -> str:
    """A session opened and initialized with ``token``; its id."""
    opened = await initialize(http, url, token)
    assert opened.status_code == 200, (opened.status_code, opened.text)
    session = opened.headers[SESSION]
    done = await http.post(
        url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers(token, session)
    )
    assert done.status_code == 202, (done.status_code, done.text)
    return session


async def list_tools(http: httpx2.AsyncClient, url: str, token: str, session: str) -> httpx2.Response:
    request = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    return await http.post(url, json=request, headers=headers(token, session))


def message(answer: httpx2.Response) -> dict[str, Any]:
    """The JSON-RPC message of an answer, whether sent as JSON or as one SSE event."""
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[5:].strip() for line in answer.text.splitlines() if line.startswith("data:")]
        return dict(json.loads(data[-1]))
    return dict(answer.json())


def jsonrpc_error(answer: httpx2.Response) -> dict[str, Any]:
    """The error object of a refused answer's JSON-RPC error body (asserting it is one)."""
    assert answer.headers.get("content-type", "").startswith("application/json"), answer.headers
    body = answer.json()
    assert body["jsonrpc"] == "2.0" and "id" in body, body
    error = body["error"]
    assert isinstance(error["code"], int) and isinstance(error["message"], str), error
    return dict(error)
