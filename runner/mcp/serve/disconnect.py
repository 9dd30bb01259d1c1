"""A call whose HTTP client went away is cancelled (its sandbox killed, its slot freed).

The SDK's answer to such a call has nowhere to go, yet the handshake-era transport runs
the handler to its end: the call would hold its ``serve.max_concurrent`` slot and its
sandbox until its deadline. So each call watches the ASGI ``receive`` of the request
that carried it; once the request body is read, the next message uvicorn gives is
``http.disconnect``, when the client closes the connection (or the answer is sent, by
which time the call is over).
"""

from __future__ import annotations

from typing import Any

import anyio

DISCONNECT = "http.disconnect"


async def cancel_when_gone(request: Any, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once the HTTP client of ``request`` disconnects; over stdio (no
    HTTP request) wait forever, to be cancelled with the call."""
    receive = getattr(request, "receive", None)
    if not callable(receive):
        await anyio.sleep_forever()
        return
    while True:
        message = await receive()
        if not isinstance(message, dict) or message.get("type") == DISCONNECT:
            break
    scope.cancel()
