"""MCP sessions over HTTP, each bound to the bearer token that opened it.

The SDK's session manager already refuses a session to any credential but the one that
opened it (404, as for an unknown session) once the request carries that credential as
its ``user``; ``runner.mcp.serve.auth`` puts the token's digest there. What the SDK lacks is
a bound per credential: one token could hold all of its 10,000 sessions. So here, under
the SDK's own admission lock (two opening requests cannot both slip under the cap), a
token with ``serve.max_sessions_per_token`` open sessions is refused another (429, with a
JSON-RPC error body), and every new session expires after ``serve.session_idle_ms``
without a request in flight or an open event stream (both read at each admission, so a
reload applies to the sessions opened after it). A token removed from the policy loses
its open sessions, event streams included.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pydantic_core
from mcp.server.auth.middleware.bearer_auth import (
    AuthenticatedUser,
    AuthorizationContext,
    authorization_context,
)
from mcp.server.lowlevel.server import Server
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.api import Runner
from runner.mcp.serve.auth import BearerAuth, send_jsonrpc_error, token_of

# JSON-RPC error (implementation-defined range) for a token at its cap of open sessions.
TOO_MANY_SESSIONS = -32012  # -32002 is MCP's own "resource not found"
INVALID_REQUEST = -32600  # JSON-RPC's own
_LOOPBACK = ("127.0.0.1", "localhost", "::1")

# The SDK's hooks this module relies on; checked at start, so that an SDK that renamed
# them stops the server rather than serving without the cap.
for _hook in ("_admit_session", "_handle_stateful_request", "_discard_session"):
    if not hasattr(StreamableHTTPSessionManager, _hook):
        raise ImportError(f"mcp's StreamableHTTPSessionManager has no {_hook}; this runner needs mcp 2.3")


class _AtCap(Exception):
    def __init__(self, held: int) -> None:
        super().__init__(held)
        self.held = held


class TokenSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager with a cap of open sessions per token and live idle expiry."""

    def __init__(
        self,
        app: Server[Any],
        runner: Runner,
        on_cap: Callable[[str, int], None],
        on_end: Callable[[str], Awaitable[None]],
        **options: Any,
    ) -> None:
        serve = runner.policy.model.serve
        super().__init__(app, session_idle_timeout=serve.session_idle_ms / 1000, **options)
        self._runner = runner
        self._on_cap = on_cap
        self._on_end = on_end  # the runner session of an MCP session ends with it
        # (session, request id) of the requests being answered: the SDK keeps one stream
        # per id, and a second request with the id of one in flight took over its stream,
        # leaving the first unanswered and its connection held open for good.
        self._in_flight: set[tuple[str, str]] = set()
        if not isinstance(getattr(self, "_session_owners", None), dict):
            raise RuntimeError("mcp's session manager records no session owners; this runner needs mcp 2.3")

    def _admit_session(self, requestor: AuthorizationContext | None) -> StreamableHTTPServerTransport | None:
        """Called under the SDK's admission lock: counting and registering are one step."""
        serve = self._runner.policy.model.serve
        if requestor is None:  # not through BearerAuth: no owner to bind the session to
            raise _AtCap(0)
        held = sum(1 for owner in self._session_owners.values() if owner == requestor)
        if held >= serve.max_sessions_per_token:
            raise _AtCap(held)
        self.session_idle_timeout = serve.session_idle_ms / 1000
        return super()._admit_session(requestor)

    async def _handle_stateful_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        claimed = None
        if scope.get("method") == "POST":
            body, receive = await _buffered(receive)
            claimed = _request_key(scope, body)
            if claimed is not None and not self._owns(scope, claimed[0]):
                claimed = None  # the SDK answers it 404, as for a session that does not exist
            if claimed is not None and claimed in self._in_flight:
                message = (
                    f"a request with id {claimed[1]} is already in flight in this session:"
                    " give each request of a session its own id"
                )
                await send_jsonrpc_error(send, 409, INVALID_REQUEST, message)
                return
            if claimed is not None:
                self._in_flight.add(claimed)
                send = _releasing(send, lambda: self._in_flight.discard(claimed))
        try:
            await super()._handle_stateful_request(scope, receive, send)
        except _AtCap as refused:  # raised before anything was sent
            cap = self._runner.policy.model.serve.max_sessions_per_token
            entry = token_of(scope)
            self._on_cap(entry.name if entry is not None else "", refused.held)
            message = (
                f"this token has {refused.held} open MCP sessions, its cap (serve.max_sessions_per_token"
                f" {cap}); end one (HTTP DELETE) or let one expire, then open a new one"
            )
            await send_jsonrpc_error(send, 429, TOO_MANY_SESSIONS, message)
        finally:
            if claimed is not None:
                self._in_flight.discard(claimed)

    def _owns(self, scope: Scope, session_id: str) -> bool:
        """Whether the request's token opened that session (the SDK's own test)."""
        user = scope.get("user")
        requestor = authorization_context(user) if isinstance(user, AuthenticatedUser) else None
        return session_id in self._session_owners and self._session_owners[session_id] == requestor

    async def _discard_session(self, session_id: str, transport: StreamableHTTPServerTransport) -> None:
        try:
            await super()._discard_session(session_id, transport)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_end(session_id)

    async def close_revoked(self, live: set[str]) -> int:
        """End every session whose token's digest is not in ``live``; how many."""
        ended = 0
        for session_id, owner in list(self._session_owners.items()):
            transport = self._server_instances.get(session_id)
            if owner["client_id"] not in live and transport is not None:
                await self._discard_session(session_id, transport)
                ended += 1
        return ended


def http_app(
    server: Server[Any],
    runner: Runner,
    host: str,
    path: str,
    inner: Callable[[ASGIApp], ASGIApp] = lambda app: app,
    on_session_end: Callable[[str], Awaitable[None]] | None = None,
) -> ASGIApp:
    """The streamable HTTP app at ``path`` behind bearer tokens (``BearerAuth`` outermost);
    ``inner`` wraps what only requests with a valid token reach."""
    security = None
    if host in _LOOPBACK:  # as the SDK does: DNS rebinding protection on loopback
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    auth: BearerAuth

    def on_cap(name: str, held: int) -> None:
        auth.session_refused(name, held)

    manager = TokenSessionManager(
        server, runner, on_cap, on_session_end or _nothing, security_settings=security
    )
    app = Starlette(
        routes=[Route(path, endpoint=StreamableHTTPASGIApp(manager))],
        lifespan=lambda _app: manager.run(),
    )
    auth = BearerAuth(inner(app), runner, manager.close_revoked)
    return auth


async def _nothing(_: str) -> None:
    return None


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """The request's body (the SDK's body limit has already read it into memory), and a
    ``receive`` that gives it again, then what comes after."""
    chunks = []
    after: Message | None = None  # a disconnect that came instead of the rest
    while True:
        message = await receive()
        if message["type"] != "http.request":
            after = message
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    replayed = False

    async def again() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True  # a body cut short stays cut short: the disconnect follows
            return {"type": "http.request", "body": body, "more_body": after is not None}
        return after if after is not None else await receive()

    return body, again


def _releasing(send: Send, release: Callable[[], None]) -> Send:
    """``send``, which calls ``release`` just before the answer's last bytes go out: the
    client, once answered, may use the id again at once."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            release()
        await send(message)

    return sending


def _request_key(scope: Scope, body: bytes) -> tuple[str, str] | None:
    """(session id, request id as the SDK keys it) of a JSON-RPC request to a session."""
    session = next((value for name, value in scope.get("headers", []) if name == b"mcp-session-id"), None)
    if session is None:
        return None
    try:
        parsed = pydantic_core.from_json(body)  # the SDK's parser: the same id, duplicate keys alike
    except ValueError:
        return None  # the SDK answers it
    if not isinstance(parsed, dict) or "method" not in parsed or parsed.get("id") is None:
        return None  # a notification or a response: no stream of its own
    return session.decode("latin-1"), str(parsed["id"])
