"""Bearer tokens of ``runner serve --http``.

The policy keeps only each token's SHA-256 (``serve.tokens``: name, sha256, role), so a
leaked policy file leaks no token. Every HTTP request must carry ``Authorization: Bearer
TOKEN``; one without, or with a token not in the policy as it is now (reloads included),
is answered 401 with a JSON-RPC error body (MCP clients show its message) and audited as
``serve.auth``, within a budget per peer (``runner.mcp.serve.refusals``). A known token's entry
travels with the request to the handlers (its role for the policy, its name as ``client``
in the audit), and its digest as the request's ``user``: the SDK binds each MCP session to
the user that opened it (``runner.mcp.serve.sessions``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runner.api import Runner
from runner.call.policy import ServeTokenModel
from runner.mcp.serve.refusals import RefusalBudget

# Where the request's token entry is put in the ASGI scope for the handlers.
SCOPE_KEY = "runner.token"
TOKEN_PREFIX = "rnr_"  # noqa: S105 - a prefix, not a secret
# JSON-RPC error (implementation-defined range) of a request without a known token.
UNAUTHORIZED = -32011
_UNAUTHORIZED_MESSAGE = "unauthorized: send Authorization: Bearer TOKEN with a token of this server"
# How often expired refusal windows are summarised and revoked tokens' sessions ended.
HOUSEKEEPING_S = 1.0

# Given the live tokens' digests, ends the sessions of any other token; how many it ended.
CloseRevoked = Callable[[set[str]], Awaitable[int]]


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh token: 256 random bits, prefixed so that secret scanners can spot one."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def find_token(tokens: list[ServeTokenModel], token: str) -> ServeTokenModel | None:
    """The entry whose digest is ``token``'s; every entry is compared, in constant time."""
    digest = token_digest(token)
    found = None
    for entry in tokens:
        if hmac.compare_digest(entry.sha256, digest):
            found = entry
    return found


def token_of(scope: Scope) -> ServeTokenModel | None:
    entry = scope.get(SCOPE_KEY)
    return entry if isinstance(entry, ServeTokenModel) else None


class BearerAuth:
    """ASGI middleware: only requests with a known bearer token reach ``app``."""

    def __init__(self, app: ASGIApp, runner: Runner, close_revoked: CloseRevoked | None = None) -> None:
        self._app = app
        self._runner = runner
        self._close_revoked = close_revoked
        self._tokens_seen = runner.policy.model.serve.tokens
        audit = runner.audit
        self._refusals = RefusalBudget(lambda **fields: audit.emit("serve.auth", decision="deny", **fields))
        self._over_cap = RefusalBudget(
            lambda **fields: audit.emit("serve.session", decision="deny", **fields), key_field="client"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the app's own start-up and shut-down
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        token = _bearer(scope)
        entry = find_token(self._runner.policy.model.serve.tokens, token) if token else None
        if entry is None:
            client = scope.get("client")
            self._refusals.refused(
                client[0] if client else None,
                reason="missing_token" if token is None else "unknown_token",
                peer=f"{client[0]}:{client[1]}" if client else None,
                method=scope.get("method"),
                path=scope.get("path"),
            )
            challenge = (b"www-authenticate", b'Bearer realm="runner"')
            await send_jsonrpc_error(send, 401, UNAUTHORIZED, _UNAUTHORIZED_MESSAGE, [challenge])
            return
        # The digest, never the token, names the session's owner.
        user = AuthenticatedUser(AccessToken(token=entry.sha256, client_id=entry.sha256, scopes=[]))
        await self._app({**scope, SCOPE_KEY: entry, "user": user}, receive, send)

    def session_refused(self, client: str, held: int) -> None:
        """A token at its cap of sessions was refused one more (audited within a budget)."""
        self._over_cap.refused(client, reason="session_cap", client=client, held=held)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def shut_down(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                self._flush()
            await send(message)

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._housekeeping)
                await self._app(scope, receive, shut_down)
                tasks.cancel_scope.cancel()
        finally:
            self._flush()  # no count is lost, however the server stops

    async def _housekeeping(self) -> None:
        while True:
            await anyio.sleep(HOUSEKEEPING_S)
            self._refusals.sweep()
            self._over_cap.sweep()
            tokens = self._runner.policy.model.serve.tokens
            if tokens is not self._tokens_seen and self._close_revoked is not None:
                self._tokens_seen = tokens
                ended = await self._close_revoked({entry.sha256 for entry in tokens})
                if ended:
                    audit = self._runner.audit
                    audit.emit("serve.session", decision="end", reason="token_revoked", count=ended)

    def _flush(self) -> None:
        self._refusals.flush()
        self._over_cap.flush()


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


async def send_jsonrpc_error(
    send: Send, status: int, code: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An HTTP error whose body is a JSON-RPC error (no request id), which MCP clients show."""
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}).encode()
    start: dict[str, Any] = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *(headers or []),
        ],
    }
    await send(start)
    await send({"type": "http.response.body", "body": body})
