"""The MCP handlers in front of one long-lived ``Runner``.

``tools/list`` gives what the caller's role may call; ``tools/call`` goes through the whole
guard (``Runner.ahandle``) and maps the answer shell onto MCP: a success is the result as
JSON text (and ``structuredContent`` when the tool has an object output schema), a failure
``isError`` with text that begins with the error code. The SDK turns what the protocol
itself rejects (unknown method, malformed params) into JSON-RPC errors. A cancelled request
cancels its handler, and a cancelled ``ahandle`` kills its sandbox before it re-raises.
"""

from __future__ import annotations

import asyncio
import json
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types as types
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter

from runner.api import Runner
from runner.audit.log import AUDIT_CLIENT
from runner.call.approval import CALL_APPROVER
from runner.call.plan import resolve_plan
from runner.call.requests import CallOptions
from runner.call.session_scope import no_session, restarted_wire
from runner.errors import CallError
from runner.mcp.hosted.dialogue import CALL_PROGRESS
from runner.mcp.serve.approval import SpentAnswers, ask_first, client_approver, state_boundary
from runner.mcp.serve.call_sessions import McpSessions, mcp_session_id
from runner.mcp.serve.client_limits import gives_up_first
from runner.mcp.serve.disconnect import cancel_when_gone
from runner.mcp.serve.events import EventRelay, LogLevels
from runner.mcp.serve.slots import FairSlots
from runner.telemetry.labels import role_label
from runner.telemetry.tracing import TRACEPARENT, TRACESTATE
from runner.tools.definitions import mcp_definition
from runner.tools.manifest import Tool

SERVER_NAME = "runner"
# Keys of ours in an MCP request's or result's `_meta` (namespaced, as MCP asks).
REQUEST_ID_META = "dev.runner/requestId"
ERROR_META = "dev.runner/error"
DURATION_META = "dev.runner/durationMs"  # the runner's own time for the call (the answer's duration)
TRACE_ID_META = "dev.runner/traceId"  # the answer's traceId: the call's W3C trace id
# JSON-RPC error (implementation-defined range) for a call that arrives while the server drains.
SHUTTING_DOWN = -32001


@dataclass(frozen=True)
class Caller:
    """Who a request is served for: the role its calls get, and its name in the audit trail."""

    role: str | None
    client: str | None = None


CallerOf = Callable[[ServerRequestContext[Any, Any]], Caller]


class ToolService:
    """``tools/list`` and ``tools/call`` of one runner, with a bound on calls running at once.

    ``caller_of`` says who sent a request (stdio: the ``--role``; HTTP: the bearer token's
    entry, see ``runner.mcp.serve.auth``).
    """

    def __init__(self, runner: Runner, caller_of: CallerOf, max_concurrent: int) -> None:
        self.runner = runner
        self._caller_of = caller_of
        self._slots = FairSlots(max_concurrent)
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        # 2026-07-28 clients hear of changes on `subscriptions/listen` streams; handshake-era
        # connections on their standalone stream (the ones seen so far, while they live).
        self._bus = InMemorySubscriptionBus()
        self._listen = ListenHandler(self._bus)
        self._connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        self.sessions = McpSessions(runner)  # each MCP session's runner session
        self._log_levels = LogLevels()
        self._spent = SpentAnswers()  # 2026-07-28 approvals already used
        self._warned: set[tuple[str | None, int]] = set()

    def server(self) -> Server[Any]:
        """The SDK's low-level server with this service's handlers."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            ours = version("sandboxed-tool-runner")
        except PackageNotFoundError:
            ours = ""
        with warnings.catch_warnings():
            # Logging is deprecated by the 2026-07-28 protocol; clients before it use it.
            warnings.simplefilter("ignore", MCPDeprecationWarning)
            server: Server[Any] = Server(
                SERVER_NAME,
                version=ours,
                on_list_tools=self.list_tools,
                on_call_tool=self.call_tool,
                on_subscriptions_listen=self._listen,
                on_set_logging_level=self._log_levels.set_level,
            )
        server.middleware.append(state_boundary(SERVER_NAME))  # approvals asked of 2026-07-28 clients
        return server

    @staticmethod
    def initialization_options(server: Server[Any]) -> InitializationOptions:
        return server.create_initialization_options(NotificationOptions(tools_changed=True))

    async def list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        self._remember(ctx)
        try:
            tools = self.runner.callable_tools(self._caller_of(ctx).role)
        except CallError as exc:  # an unknown role: nothing to list, and the client is told why
            raise MCPError(types.INVALID_REQUEST, exc.message) from None
        self._warn_if_client_gives_up_first(ctx, tools)
        definitions = [types.Tool.model_validate(mcp_definition(tool)) for tool in tools]
        return types.ListToolsResult(tools=definitions)

    def _warn_if_client_gives_up_first(self, ctx: ServerRequestContext[Any, Any], tools: list[Tool]) -> None:
        """Once per client name and deadline: a client known to end calls sooner than the
        longest deadline of the tools it is listed (``runner.mcp.serve.client_limits``)."""
        client_params = getattr(ctx.session, "client_params", None)
        name = client_params.client_info.name if client_params is not None else None
        plans = (resolve_plan(tool, self.runner.policy, CallOptions()) for tool in tools)
        deadline_ms = max((plan.deadline_ms for plan in plans), default=0)
        limit = gives_up_first(name, deadline_ms)
        if limit is None or (name, deadline_ms) in self._warned:
            return
        self._warned.add((name, deadline_ms))
        self.runner.audit.operator.warn(
            f"serve: client {name!r} ends a call after {limit:g} s, sooner than the largest deadline of"
            f" its tools ({deadline_ms} ms): its calls that run that long are cut off before the"
            " runner's TIMEOUT answer; lower those deadlines for it"
        )

    async def call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        self._remember(ctx)
        if self._draining:
            raise MCPError(SHUTTING_DOWN, "the server is shutting down; call again on a new one")
        caller = self._caller_of(ctx)
        if (question := await ask_first(self.runner, ctx, params, caller.role)) is not None:
            return question  # a 2026-07-28 client calls again with the person's answer
        meta = _raw_meta(ctx)
        request: dict[str, Any] = {
            "toolName": params.name,
            "params": params.arguments or {},
            "role": caller.role,
        }
        if isinstance(meta.get(REQUEST_ID_META), str):
            request["requestId"] = meta[REQUEST_ID_META]
        trace_context = _trace_context(ctx, meta)
        if trace_context:
            request["metadata"] = trace_context
        tool = self.runner.registry.get(params.name)
        wants_progress = meta.get("progressToken") is not None
        # A hosted MCP server's tool reports its own progress: passed through.
        hosted = tool is not None and tool.hosted is not None
        client_token = AUDIT_CLIENT.set(caller.client)
        approver_token = CALL_APPROVER.set(
            client_approver(ctx, caller.client or "stdio", params, self._spent)
        )
        progress_token = CALL_PROGRESS.set(ctx.session.report_progress if hosted and wants_progress else None)
        relay = EventRelay(ctx, params.name, wants_progress and not hosted, self._log_levels)
        answer: dict[str, Any] | None = None
        session = self.sessions.session_for(caller.client, mcp_session_id(ctx))
        try:
            with self._counted(), session.calls() if session else no_session() as note:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(relay.heartbeat)
                    tasks.start_soon(relay.pump)
                    tasks.start_soon(cancel_when_gone, ctx.request, tasks.cancel_scope)
                    answer = await self._run(request, tool, relay)
                    await relay.finish()
                    tasks.cancel_scope.cancel()
            if note.restarted and answer is not None:
                answer = restarted_wire(answer)
        finally:
            CALL_PROGRESS.reset(progress_token)
            CALL_APPROVER.reset(approver_token)
            AUDIT_CLIENT.reset(client_token)
        if answer is None:  # the client went away: the call was cancelled, the answer is lost
            raise MCPError(types.CONNECTION_CLOSED, "the client disconnected; the call was cancelled")
        return _to_result(answer, tool)

    @property
    def draining(self) -> bool:
        """Whether the server is stopping (new calls are refused)."""
        return self._draining

    async def call_for(self, request: dict[str, Any], client: str) -> dict[str, Any]:
        """One wire request from a client other than MCP's (the local socket), audited as
        ``client``, under the same bound on calls at once; the answer shell as ``handle`` gives it.

        Raises:
            asyncio.CancelledError: the call was cancelled (its sandbox is gone by then).
        """
        name = request.get("toolName")
        tool = self.runner.registry.get(name) if isinstance(name, str) else None
        client_token = AUDIT_CLIENT.set(client)
        try:
            with self._counted():
                if not isinstance(request.get("options", {}), dict):
                    tool = None  # refused by the runner at once: no slot needed
                return await self._run(request, tool, None)
        finally:
            AUDIT_CLIENT.reset(client_token)

    async def _run(
        self, request: dict[str, Any], tool: Tool | None, relay: EventRelay | None
    ) -> dict[str, Any]:
        """Run the call once a slot is free; waiting counts against the call's deadline."""
        if tool is None:  # refused at once (TOOL_NOT_FOUND): no sandbox, no slot needed
            return await self.runner.ahandle(request)
        deadline_ms = resolve_plan(tool, self.runner.policy, CallOptions()).deadline_ms
        started = time.monotonic()
        client = AUDIT_CLIENT.get()
        try:
            async with asyncio.timeout(deadline_ms / 1000):
                await self._slots.acquire(client)
        except TimeoutError:
            return self._queued_out(request, deadline_ms)
        try:
            waited_ms = round((time.monotonic() - started) * 1000)
            if waited_ms:
                options = request.get("options") or {}
                left = max(1, deadline_ms - waited_ms)
                given = options.get("deadline")
                if isinstance(given, int) and not isinstance(given, bool):
                    left = max(1, given - waited_ms)  # the caller's own deadline, less the wait
                request["options"] = {**options, "deadline": left}
            return await self.runner.ahandle(request, relay.heard if relay is not None else None)
        finally:
            self._slots.release(client)

    def _queued_out(self, request: dict[str, Any], deadline_ms: int) -> dict[str, Any]:
        """The answer of a call whose deadline ran out while it waited for a slot."""
        message = f"{request['toolName']} waited {deadline_ms} ms for a free slot (serve.max_concurrent)"
        asked = request.get("role")  # none from a socket client that named none: the default
        caller = self.runner.policy.resolve_role(asked if isinstance(asked, str) else None)
        error = {"code": "TIMEOUT", "message": message, "details": {"reason": "queued"}, "retryable": True}
        self.runner.audit.emit(
            "call.finished",
            toolName=request["toolName"],
            requestId=request.get("requestId"),
            role=caller,
            success=False,
            code="TIMEOUT",
            reason="queued",
            attempts=0,
            duration=deadline_ms,
        )
        metrics = self.runner.metrics
        if metrics is not None:  # a registered tool (a slot is waited for only then)
            role = role_label(caller, lambda role: role in self.runner.policy.model.roles)
            metrics.count_call(request["toolName"], "TIMEOUT", role, deadline_ms / 1000)
        return {
            "success": False,
            "result": None,
            "error": error,
            "metadata": {"requestId": request.get("requestId"), "toolName": request["toolName"]},
        }

    @contextmanager
    def _counted(self) -> Iterator[None]:
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def drain(self) -> None:
        """Refuse new calls and wait for those in flight (each ends by its deadline)."""
        self._draining = True
        await self._idle.wait()

    async def tools_changed(self) -> None:
        """Tell every client that the tool list changed (best effort: the SDK drops a
        notification for a connection that is gone)."""
        await self._bus.publish(ToolsListChanged())
        for connection in list(self._connections):
            await connection.send_tool_list_changed()

    def close(self) -> None:
        self._listen.close()

    def _remember(self, ctx: ServerRequestContext[Any, Any]) -> None:
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            # The SDK hands the connection to handlers only through the request's session
            # until its Context rework; its standalone stream is where list_changed goes.
            self._connections.add(ctx.session._connection)


def _trace_context(ctx: ServerRequestContext[Any, Any], meta: dict[str, Any]) -> dict[str, str]:
    """The caller's W3C trace context: ``_meta.traceparent`` (and ``tracestate``),
    else the HTTP request's ``traceparent`` header; the runner ignores one that does not parse."""
    source: Mapping[str, Any] = meta
    if TRACEPARENT not in meta:
        request = ctx.request
        headers = getattr(request, "headers", None)
        if not isinstance(headers, Mapping) or TRACEPARENT not in headers:
            return {}
        source = headers
    return {key: source[key] for key in (TRACEPARENT, TRACESTATE) if isinstance(source.get(key), str)}


def _raw_meta(ctx: ServerRequestContext[Any, Any]) -> dict[str, Any]:
    meta = (ctx.params or {}).get("_meta")
    return meta if isinstance(meta, dict) else {}


def _to_result(answer: dict[str, Any], tool: Tool | None) -> types.CallToolResult:
    meta: dict[str, Any] = {
        REQUEST_ID_META: answer["metadata"].get("requestId"),
        DURATION_META: answer["metadata"].get("duration"),
        TRACE_ID_META: answer["metadata"].get("traceId"),
    }
    if not answer["success"]:
        error = answer["error"]
        meta[ERROR_META] = error
        text = f"{error['code']}: {error['message']}"
        failure = types.TextContent(type="text", text=text)
        return types.CallToolResult(content=[failure], is_error=True, _meta=meta)
    result = answer["result"]
    text = json.dumps(result, ensure_ascii=False, allow_nan=False)
    structured = None
    if tool is not None and isinstance(result, dict) and _has_object_output(tool):
        structured = result
    # The tool's content blocks follow the result's text.
    blocks = _BLOCKS.validate_python(answer.get("content", []))
    content = [types.TextContent(type="text", text=text), *blocks]
    return types.CallToolResult(content=content, structured_content=structured, _meta=meta)


_BLOCKS: TypeAdapter[list[types.ContentBlock]] = TypeAdapter(list[types.ContentBlock])


def _has_object_output(tool: Tool) -> bool:
    schema = tool.manifest.output_schema
    return isinstance(schema, dict) and schema.get("type") == "object"
