"""Speaking MCP with a server in a sandbox: the official SDK's ``ClientSession`` over the
sandbox's pipe (``sandboxes.Dialogue``), for one listing or one call.

The transport is the SDK's stdio one in miniature: newline-delimited JSON-RPC, each line
parsed with the SDK's own message adapter. It differs where a sandbox makes it differ:
the server's process belongs to the sandbox (this never starts, stops or waits for it),
and a line that is not JSON-RPC ends the conversation at once as a broken protocol
instead of being logged and skipped: a tool's answer is never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.session import ClientSession
from mcp.shared.dispatcher import ProgressFnT
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from sandboxes import Pipe

# How much of what broke the protocol is kept (scrubbed of secrets, then cut, by
# ``answers.protocol_error``: a secret cut in half first would pass the scrub).
EVIDENCE_CHARS = 4096
CLIENT_INFO = types.Implementation(name="runner", version="1")


@dataclass
class Spoken:
    """What a conversation came to; at most one of the fields is set once ``talk`` returns
    (none: the server went away first, and the sandbox's outcome says how)."""

    tools: list[types.Tool] | None = None
    result: types.CallToolResult | None = None
    refused: str | None = None  # the server answered the request with a JSON-RPC error
    broken: str | None = None  # how the server broke the protocol
    evidence: str = ""  # what it wrote, or the SDK's complaint: raw, not for an answer as is

    def break_(self, how: str, evidence: str = "") -> None:
        self.broken, self.evidence = how, evidence[:EVIDENCE_CHARS]


class _Conversation:
    """The part both dialogues share: the session over the pipe, the verdict kept."""

    def __init__(self) -> None:
        self.spoken = Spoken()

    async def talk(self, pipe: Pipe) -> None:
        incoming_send, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](16)
        outgoing, outgoing_receive = anyio.create_memory_object_stream[SessionMessage](16)
        async with incoming_send, incoming, outgoing, outgoing_receive, anyio.create_task_group() as group:
            group.start_soon(self._read, pipe, incoming_send, group.cancel_scope)
            group.start_soon(_write, pipe, outgoing_receive)
            try:
                async with _Session(incoming, outgoing, client_info=CLIENT_INFO) as session:
                    # Inside the session: its task group would wrap what goes out of it.
                    try:
                        await session.initialize()
                        await self.exchange(session)
                    except MCPError as exc:
                        self.spoken.refused = exc.error.message or f"error {exc.error.code}"
            except Exception as exc:  # the SDK's word that the answer broke the protocol
                self.spoken.break_(*_complaint(exc))
            group.cancel_scope.cancel()  # the conversation is over; the pipe tasks with it

    async def exchange(self, session: ClientSession) -> None:
        raise NotImplementedError

    async def _read(
        self,
        pipe: Pipe,
        sink: MemoryObjectSendStream[SessionMessage | Exception],
        scope: anyio.CancelScope,
    ) -> None:
        """Lines of stdout to messages. A line that is not JSON-RPC ends the conversation;
        at the end of stdout this waits: the server's exit or the timeout tells the rest."""
        pending = bytearray()
        while chunk := await pipe.receive():
            start = len(pending)  # a newline can only be in what just came
            pending += chunk
            while (end := pending.find(b"\n", start)) != -1:
                line, start = bytes(pending[:end]), 0
                del pending[: end + 1]
                if not line.strip():
                    continue
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError:
                    text = line.decode("utf-8", errors="replace")
                    self.spoken.break_("it wrote a line that is not JSON-RPC", text)
                    scope.cancel()
                    return
                await sink.send(SessionMessage(message))
        await anyio.sleep_forever()


def _complaint(exc: BaseException) -> tuple[str, str]:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"the MCP client refused its answer ({type(exc).__name__})", str(exc)


class _Session(ClientSession):
    """The SDK's client session, minus its own check of a call's result.

    That check lists the server's tools again inside the call and validates the answer
    against the output schema the server offers *then*: a schema the runner never
    checked, applied on the event loop (a catastrophic regex pattern stalls every call
    the loop serves, past any timeout). The runner validates a result against the
    ``outputSchema`` it listed and checked at load, off the loop (``output_schema``).
    """

    async def validate_tool_result(self, name: str, result: types.CallToolResult) -> None:
        return None


async def _write(pipe: Pipe, source: MemoryObjectReceiveStream[SessionMessage]) -> None:
    """Messages to lines on stdin. A server that closed its stdin is left to its fate."""
    async for outgoing in source:
        line = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
        try:
            await pipe.send(line.encode("utf-8"))
        except ConnectionError:
            await anyio.sleep_forever()


class ListTools(_Conversation):
    """``initialize``, then ``tools/list`` through every page."""

    async def exchange(self, session: ClientSession) -> None:
        tools: list[types.Tool] = []
        cursor: str | None = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        self.spoken.tools = tools


class CallTool(_Conversation):
    """``initialize``, then one ``tools/call``; the server's progress goes to ``progress``."""

    def __init__(self, name: str, arguments: dict[str, Any], progress: ProgressFnT | None = None) -> None:
        super().__init__()
        self._name = name
        self._arguments = arguments
        self._progress = progress

    async def exchange(self, session: ClientSession) -> None:
        self.spoken.result = await session.call_tool(
            self._name, self._arguments, progress_callback=self._progress
        )
