"""A hosted server held for a session: one conversation, initialized once, in which each
call of the session speaks its own ``tools/call``.

``HeldServer`` is the ``Dialogue`` of the session's one run of the server: its ``talk``
opens the SDK's client session over the pipe, says ``initialize``, then speaks the
calls ``serve`` hands it, one at a time, until the run ends (the session closes, the
server dies, a call times out). Every call is a ``HostedCall`` as outside sessions: its
result, refusal, progress and log messages are its own; request ids go on counting in
the one client session, never reused. A server that breaks the protocol ends the
conversation: the call being served says so (``PARSE_ERROR``), the next starts a new one.
"""

from __future__ import annotations

import asyncio

import mcp_types as types
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError

from runner.call.hosting import HostedDialogue
from runner.mcp.hosted.dialogue import HostedCall
from runner.mcp.hosted.session import _complaint, _Conversation
from sandboxes import Pipe


class ConversationOver(Exception):
    """The held conversation has ended: the server is gone or broke the protocol."""


class HeldServer(_Conversation):
    """The session's conversation with one hosted server."""

    def __init__(self) -> None:
        super().__init__(self._log)
        self._calls: asyncio.Queue[tuple[HostedCall, asyncio.Future[None]]] = asyncio.Queue()
        self._serving: tuple[HostedCall, asyncio.Future[None]] | None = None
        self._over = False

    async def serve(self, call: HostedDialogue) -> None:
        """Speak ``call`` in the held conversation; return once it is answered.

        Raises:
            ConversationOver: the conversation ended first (``call`` says so if the
                server broke the protocol).
        """
        if not isinstance(call, HostedCall):
            raise TypeError(f"a held server speaks HostedCall dialogues, not {type(call).__name__}")
        if self._over:
            raise ConversationOver
        answered = asyncio.get_running_loop().create_future()
        await self._calls.put((call, answered))
        await answered

    async def exchange(self, session: ClientSession) -> None:
        try:
            while True:
                call, answered = await self._calls.get()
                if answered.done():  # cancelled while it waited: its caller is gone
                    continue
                self._serving = call, answered
                self._bytes_read = 0  # each call's own bytes (``cap_calls``)
                try:
                    await call.exchange(session)
                except MCPError as exc:
                    call.spoken.refuse(exc)
                except Exception as exc:  # the SDK refused the answer: this call is broken
                    call.spoken.break_(*_complaint(exc))
                    raise
                self._serving = None
                if not answered.done():
                    answered.set_result(None)
        finally:
            self._end()

    def cap_calls(self, max_output_bytes: int) -> None:
        self._read_cap = max_output_bytes

    async def talk(self, pipe: Pipe) -> None:
        try:
            await super().talk(pipe)
        finally:
            self._end()

    def _end(self) -> None:
        """The conversation is over: the call being served, and any waiting, learn it."""
        self._over = True
        waiting = [self._serving] if self._serving is not None else []
        self._serving = None
        while not self._calls.empty():
            waiting.append(self._calls.get_nowait())
        for call, answered in waiting:
            if self.spoken.broken is not None and call.spoken.broken is None:
                call.spoken.break_(self.spoken.broken, self.spoken.evidence)
            if not answered.done():
                answered.set_exception(ConversationOver())

    async def _log(self, params: types.LoggingMessageNotificationParams) -> None:
        if self._serving is not None:
            await self._serving[0].log(params)
