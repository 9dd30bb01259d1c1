"""``runner serve --http HOST:PORT``: MCP streamable HTTP at ``/mcp`` behind bearer tokens.

Loopback by default. uvicorn serves the SDK's Starlette app; its own signal handling is
off, as the server's drain (``runner.mcp.serve.lifecycle``) decides when it stops.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from mcp.server.context import ServerRequestContext
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.mcp.serve.app import Caller, ToolService
from runner.mcp.serve.auth import token_of
from runner.mcp.serve.connections import gated_h11
from runner.mcp.serve.sessions import http_app
from runner.telemetry.connections import ACCEPT_BACKLOG, ConnectionGate, ConnectionLimits, listen_long

MCP_PATH = "/mcp"
DEFAULT_HOST = "127.0.0.1"
# How long uvicorn waits for open connections (a client's event stream) after a stop.
GRACEFUL_S = 3
UNAUTHORIZED = 401
CLOSE = (b"connection", b"close")


class HttpAddressError(ValueError):
    """``--http`` is not ``HOST:PORT`` or ``PORT``."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (loopback).

    Raises:
        HttpAddressError: anything else.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = DEFAULT_HOST, text
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise HttpAddressError(f"--http {text!r} is not HOST:PORT")
    return host, int(port)


def http_caller(ctx: ServerRequestContext[Any, Any]) -> Caller:
    """The caller of an HTTP request: its token's role and name (``BearerAuth`` let it in)."""
    request = ctx.request
    entry = token_of(request.scope) if request is not None and hasattr(request, "scope") else None
    if entry is None:  # not through BearerAuth: no role, so the policy denies everything
        return Caller(role=None, client=None)
    return Caller(role=entry.role, client=entry.name)


class TrustAuthorized:
    """ASGI middleware behind ``BearerAuth``: a request that reaches it carried a valid
    token, so its connection is trusted by the gate (no longer evicted for newer ones)."""

    def __init__(self, app: ASGIApp, gate: ConnectionGate) -> None:
        self._app = app
        self._gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if scope["type"] == "http" and client is not None:
            self._gate.trust((client[0], client[1]))
        await self._app(scope, receive, send)


class CloseRefused:
    """ASGI middleware in front of ``BearerAuth``: a 401 closes its connection, so a client
    without a token holds none after its answer."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == UNAUTHORIZED:
                message = {**message, "headers": [*message.get("headers", []), CLOSE]}
            await send(message)

        await self._app(scope, receive, send_closing)


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the lifecycle handles SIGTERM/SIGINT/SIGHUP

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or ():
            listen_long(sock)


class HttpTransport:
    """The streamable HTTP app on a socket bound at construction (so the port is known)."""

    def __init__(self, service: ToolService, host: str, port: int, limits: ConnectionLimits) -> None:
        """Raises ``OSError`` when the address cannot be bound."""
        server = service.server()
        self.gate = ConnectionGate(limits)
        gate = self.gate
        app = http_app(
            server,
            service.runner,
            host,
            MCP_PATH,
            inner=lambda app: TrustAuthorized(app, gate),
            on_session_end=service.sessions.end,
        )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        # Answers go out as several small writes (an SSE event stream): without this,
        # Nagle's algorithm and the client's delayed ACK hold each answer back (by tens of ms).
        # Accepted connections inherit it.
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        config = uvicorn.Config(
            CloseRefused(app),
            http=gated_h11(self.gate),
            # MCP is plain HTTP: an upgrade to a WebSocket would pass the bearer check
            # (an ASGI "websocket", not "http") and leave the gate's count of its connection.
            ws="none",
            # A client's address is its socket's peer: uvicorn would believe X-Forwarded-For
            # from any loopback peer, so any local user could name itself in the audit, and
            # a token client behind a proxy would not be the peer the gate trusts.
            proxy_headers=False,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=math.ceil(limits.idle_timeout_s),
            backlog=ACCEPT_BACKLOG,
            timeout_graceful_shutdown=GRACEFUL_S,
        )
        self._server = _QuietServer(config)
        bound_host, bound_port = self._socket.getsockname()[:2]
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        self.url = f"http://{shown}:{bound_port}{MCP_PATH}"

    async def serve(self) -> None:
        with self._socket:
            await self._server.serve(sockets=[self._socket])

    def stop(self) -> None:
        self._server.should_exit = True
