"""Bearer tokens of ``runner serve --http``.

The policy keeps only each token's SHA-256 (``serve.tokens``: name, sha256, role), so a
leaked policy file leaks no token. Every HTTP request must carry ``Authorization: Bearer
TOKEN``; one without, or with a token not in the policy as it is now (reloads included),
is answered 401 and audited as ``serve.auth``. A known token's entry travels with the
request to the handlers (its role for the policy, its name as ``client`` in the audit).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from runner.api import Runner
from runner.call.policy import ServeTokenModel

# Where the request's token entry is put in the ASGI scope for the handlers.
SCOPE_KEY = "runner.token"
TOKEN_PREFIX = "rnr_"  # noqa: S105 - a prefix, not a secret
_UNAUTHORIZED = json.dumps({"error": "unauthorized: send Authorization: Bearer TOKEN"}).encode()


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

    def __init__(self, app: ASGIApp, runner: Runner) -> None:
        self._app = app
        self._runner = runner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: the app's own start-up and shut-down
            await self._app(scope, receive, send)
            return
        token = _bearer(scope)
        entry = find_token(self._runner.policy.model.serve.tokens, token) if token else None
        if entry is None:
            client = scope.get("client")
            self._runner.audit.emit(
                "serve.auth",
                decision="deny",
                reason="missing_token" if token is None else "unknown_token",
                peer=f"{client[0]}:{client[1]}" if client else None,
                method=scope.get("method"),
                path=scope.get("path"),
            )
            await _send_401(send)
            return
        await self._app({**scope, SCOPE_KEY: entry}, receive, send)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


async def _send_401(send: Send) -> None:
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"www-authenticate", b'Bearer realm="runner"'),
        (b"content-length", str(len(_UNAUTHORIZED)).encode()),
    ]
    start: dict[str, Any] = {"type": "http.response.start", "status": 401, "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": _UNAUTHORIZED})
