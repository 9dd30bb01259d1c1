"""Speaking MCP with a server in a sandbox: the official SDK's ``ClientSession`` over the
sandbox's pipe (``sandboxes.Dialogue``), for one listing or one call.

The transport is the SDK's stdio one in miniature: newline-delimited JSON-RPC, each line
parsed with the SDK's own message adapter. It differs where a sandbox makes it differ:
the server's process belongs to the sandbox (this never starts, stops or waits for it),
and a line that is not JSON-RPC ends the conversation at once as a broken protocol
instead of being logged and skipped: a tool's answer is never guessed.

A server started ahead by a warm pool is initialized ahead too: ``Handshake``
is the ``sandboxes.Opening`` that says ``initialize`` and ``notifications/initialized``
from the pool's thread, as ``ClientSession.initialize`` would; the call's conversation
then ``adopt``s its ``InitializeResult`` (the SDK's own way to take a handshake done
elsewhere) and goes straight to its request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.session import ClientSession, LoggingFnT
from mcp.shared.dispatcher import ProgressFnT
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION
from pydantic import ValidationError

from sandboxes import OpeningFailed, OpeningPipe, Pipe

# How much of what broke the protocol is kept (scrubbed of secrets, then cut, by
# ``answers.protocol_error``: a secret cut in half first would pass the scrub).
EVIDENCE_CHARS = 4096
# How much of what broke a warm server's handshake the operator log shows (no call's
# secret is in a server started ahead: it has none).
PREVIEW_CHARS = 120
CLIENT_INFO = types.Implementation(name="runner", version="1")
# The id of a primed server's ``initialize``: the SDK's dispatcher numbers its own
# requests from 1, so the call's ``tools/call`` never reuses it (MCP: an id is used once
# per session).
HANDSHAKE_ID = 0


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

    def refuse(self, exc: MCPError) -> None:
        self.refused = exc.error.message or f"error {exc.error.code}"


class _Conversation:
    """The part both dialogues share: the session over the pipe, the verdict kept."""

    def __init__(self, logging: LoggingFnT | None = None) -> None:
        self.spoken = Spoken()
        self._adopted: types.InitializeResult | None = None
        self._logging = logging
        self._read_cap: int | None = None  # bytes of stdout until the conversation is over
        self._bytes_read = 0

    async def log(self, params: types.LoggingMessageNotificationParams) -> None:
        """A log message of the server's, while this conversation's request is served."""
        if self._logging is not None:
            await self._logging(params)

    def adopt(self, result: types.InitializeResult) -> None:
        """Speak with a server a ``Handshake`` already initialized: no ``initialize`` again."""
        self._adopted = result

    async def talk(self, pipe: Pipe) -> None:
        incoming_send, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](16)
        outgoing, outgoing_receive = anyio.create_memory_object_stream[SessionMessage](16)
        async with incoming_send, incoming, outgoing, outgoing_receive, anyio.create_task_group() as group:
            group.start_soon(self._read, pipe, incoming_send, group.cancel_scope)
            group.start_soon(_write, pipe, outgoing_receive)
            try:
                async with _Session(
                    incoming, outgoing, client_info=CLIENT_INFO, logging_callback=self._logging
                ) as session:
                    # Inside the session: its task group would wrap what goes out of it.
                    try:
                        if self._adopted is not None:
                            session.adopt(self._adopted)
                        else:
                            await session.initialize()
                        await self.exchange(session)
                    except MCPError as exc:
                        self.spoken.refuse(exc)
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
            self._bytes_read += len(chunk)
            if self._read_cap is not None and self._bytes_read > self._read_cap:
                self.spoken.break_(f"it wrote more than {self._read_cap} bytes for one call")
                scope.cancel()
                return
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
                try:
                    await sink.send(SessionMessage(message))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    # The session is gone: the run ended (a limit broke, the timeout
                    # passed) and cancels this task next; the outcome says how it ended.
                    await anyio.sleep_forever()
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
        try:
            await pipe.send(_line(outgoing.message))
        except ConnectionError:
            await anyio.sleep_forever()


def _line(message: types.JSONRPCMessage) -> bytes:
    return (message.model_dump_json(by_alias=True, exclude_unset=True) + "\n").encode("utf-8")


def _preview(line: bytes) -> str:
    return repr(line[:PREVIEW_CHARS].decode("utf-8", errors="replace"))


class Handshake:
    """The ``Opening`` of a hosted server started ahead: ``initialize`` as
    ``ClientSession.initialize`` says it, the answer validated with the SDK's types,
    ``notifications/initialized``; ``result`` is the server's ``InitializeResult``.

    Strict as the call's conversation is: a line that is not JSON-RPC, an answer of
    another id, a request of the server's own before the answer, a protocol version the
    SDK does not speak all fail it (the pool then discards the server; a call finds it
    out cold). Notifications before the answer (a log line) are let pass.
    """

    def __init__(self) -> None:
        self.result: types.InitializeResult | None = None

    def open(self, pipe: OpeningPipe, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        pipe.send(_line(_initialize_request()))
        buffer = b""
        while True:
            chunk = pipe.receive(max(0.0, deadline - time.monotonic()))
            if not chunk:
                raise OpeningFailed("it closed its output before answering initialize")
            *lines, buffer = (buffer + chunk).split(b"\n")
            for index, line in enumerate(lines):
                if line.strip() and self._answered(line):
                    pipe.send(_line(_initialized_notification()))
                    return b"".join(rest + b"\n" for rest in lines[index + 1 :]) + buffer

    def _answered(self, line: bytes) -> bool:
        """True when ``line`` is the answer to ``initialize`` (kept in ``result``); False for
        a notification before it.

        Raises:
            OpeningFailed: anything else.
        """
        try:
            message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except ValueError:
            raise OpeningFailed(f"it wrote a line that is not JSON-RPC: {_preview(line)}") from None
        if isinstance(message, types.JSONRPCNotification):
            return False
        if isinstance(message, types.JSONRPCError) and message.id == HANDSHAKE_ID:
            raise OpeningFailed(f"it refused initialize: {message.error.message[:PREVIEW_CHARS]}")
        if not isinstance(message, types.JSONRPCResponse) or message.id != HANDSHAKE_ID:
            raise OpeningFailed(f"it wrote something else than the answer to initialize: {_preview(line)}")
        try:
            result = types.InitializeResult.model_validate(message.result, by_name=False)
        except ValidationError as exc:
            problem = " ".join(str(exc).split())[:PREVIEW_CHARS]
            raise OpeningFailed(f"its initialize answer is not valid: {problem}") from None
        if result.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
            raise OpeningFailed(f"it speaks an unsupported protocol version: {result.protocol_version[:40]}")
        self.result = result
        return True


def _initialize_request() -> types.JSONRPCRequest:
    """``initialize`` as ``ClientSession.initialize`` builds it; the capabilities are the
    ones a session without sampling, elicitation or roots callbacks announces (none)."""
    request = types.InitializeRequest(
        params=types.InitializeRequestParams(
            protocol_version=LATEST_HANDSHAKE_VERSION,
            capabilities=types.ClientCapabilities(),
            client_info=CLIENT_INFO,
        )
    )
    data = request.model_dump(by_alias=True, mode="json", exclude_none=True)
    return types.JSONRPCRequest(jsonrpc="2.0", id=HANDSHAKE_ID, method=data["method"], params=data["params"])


def _initialized_notification() -> types.JSONRPCNotification:
    data = types.InitializedNotification().model_dump(by_alias=True, mode="json", exclude_none=True)
    return types.JSONRPCNotification(jsonrpc="2.0", **data)


class ListTools(_Conversation):
    """``initialize`` (unless adopted), then ``tools/list`` through every page."""

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
    """``initialize`` (unless adopted: a server initialized ahead), then one ``tools/call``;
    the server's progress goes to ``progress``, its log messages to ``logging``."""

    def __init__(
        self,
        name: str,
        arguments: dict[str, Any],
        progress: ProgressFnT | None = None,
        logging: LoggingFnT | None = None,
    ) -> None:
        super().__init__(logging)
        self._name = name
        self._arguments = arguments
        self._progress = progress

    async def exchange(self, session: ClientSession) -> None:
        self.spoken.result = await session.call_tool(
            self._name, self._arguments, progress_callback=self._progress
        )
