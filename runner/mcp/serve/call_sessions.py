"""The runner sessions of ``runner serve``: one per MCP client session.

An HTTP client's session is its ``Mcp-Session-Id`` (which the SDK binds to the token that
opened it), keyed here with the token's name as well, so that two clients never share
one; the stdio connection is one session. A request of the 2026-07-28 protocol over HTTP
belongs to no MCP session (that protocol has none): its calls run outside sessions. A
runner session is made at the first call of its MCP session and ended when that MCP
session ends (HTTP DELETE, its idle expiry, a revoked token; the end of stdin), which
closes its session sandboxes (``ended``).
"""

from __future__ import annotations

from typing import Any

from mcp.server.context import ServerRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from runner.api import Runner
from runner.call.session_scope import Session
from sandboxes.cancellation import finish_each

MCP_SESSION_HEADER = "mcp-session-id"
STDIO_SESSION = ""  # the key of the one session of a stdio connection


def mcp_session_id(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """The MCP session a request belongs to: its HTTP header, or the stdio connection's;
    None for an HTTP request of no session."""
    if ctx.request is None:
        return STDIO_SESSION
    if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
        # That protocol has no sessions, and the SDK checks no session header of its
        # requests: one the client sends is only its word, never a session.
        return None
    headers = getattr(ctx.request, "headers", None)
    value = headers.get(MCP_SESSION_HEADER) if headers is not None else None
    return value if isinstance(value, str) and value else None


class McpSessions:
    """Runner sessions by (client, MCP session id)."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._open: dict[tuple[str | None, str], Session] = {}

    def session_for(self, client: str | None, mcp_session: str | None) -> Session | None:
        """The runner session of this MCP session, made at its first call; None for no MCP
        session. (A request of an ended HTTP session never comes here: the SDK answers 404
        from its end on.)"""
        if mcp_session is None:
            return None
        key = (client, mcp_session)
        session = self._open.get(key)
        if session is None:
            session = self._open[key] = self._runner.session(owner=client).start()
        return session

    async def end(self, mcp_session: str) -> None:
        """The MCP session ended: so does its runner session (safe to call twice)."""
        keys = [key for key in self._open if key[1] == mcp_session]
        ended = [self._open.pop(key) for key in keys]
        await finish_each(session.aclose for session in ended)  # each, whatever one raised

    async def end_all(self) -> None:
        ended, self._open = list(self._open.values()), {}
        await finish_each(session.aclose for session in ended)  # each, whatever one raised
