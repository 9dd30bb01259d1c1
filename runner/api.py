"""``Runner``: the Python API, and the order of a call's checks.

request shape -> tool exists -> policy -> params -> circuit breaker -> execution with
retries -> output parsing. Every path ends in the same answer shell (a ``CallResult``;
the wire dict is made from it only in ``handle``) and one ``call.finished`` audit event;
a cancelled call writes that event with ``cancelled: true`` and raises on.

A runner lives from ``Runner.load`` to ``aclose`` (or the end of ``async with``): closing
cancels the calls still in flight, waits until their sandboxes are gone, then closes the
backends, the runner's validation threads and its audit log.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.audit.faults import OperatorLog, internal_error
from runner.audit.key import policy_chain_key
from runner.audit.log import AuditLog
from runner.call.answers import AnswerMetadata, CallResult
from runner.call.approval import ApproverFunction, api_approver
from runner.call.backends import Backends
from runner.call.discovery import callable_tools, discovered, tool_definitions
from runner.call.events import EventListener
from runner.call.executor import CallContext, Executor, Progress
from runner.call.guard import CallGuard, call_context, scrubbed
from runner.call.plan import CallPlan, resolve_plan
from runner.call.policy import Policy
from runner.call.pools import WarmPools
from runner.call.requests import (
    CallOptions,
    DiscoverRequest,
    new_request_id,
    parse_request,
    peek,
    wire_request,
)
from runner.call.running import InFlight, current_task, run_blocking
from runner.call.session_counts import SessionCounts
from runner.call.session_scope import Session
from runner.call.sessions import CURRENT, CallSession, is_session_tool
from runner.clock import Clock, SystemClock, iso_now
from runner.config.locations import find_policy, tool_dirs
from runner.dispatch.choice import dispatched_sandbox
from runner.errors import CallError, ConfigError
from runner.mcp.hosted.listing import ServerLister
from runner.mcp.hosted.work import MCP_WORK
from runner.telemetry.calls import CallTelemetry, Telemetry
from runner.telemetry.labels import RunnerState
from runner.tools.manifest import Tool
from runner.tools.registry import Registry
from sandboxes import Closable, Sandbox
from sandboxes.cancellation import finish_each, finish_shielded

if TYPE_CHECKING:
    from runner.telemetry.metrics import RunnerMetrics

SandboxFactory = Callable[[str], Sandbox]
_NO_OPTIONS = CallOptions()


class Runner:
    """Serves tool calls. Thread-safe; one instance may serve many concurrent calls.

    Use it as ``async with Runner.load(...) as runner:`` (or ``with`` from synchronous
    code), or call ``aclose``/``close`` when done: see ``aclose``.
    """

    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        audit: AuditLog,
        sandbox_factory: SandboxFactory,
        clock: Clock | None = None,
        *,
        warm_pools: bool = True,
        metrics: RunnerMetrics | None = None,
        approver: ApproverFunction | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.audit = audit
        self._sandbox_factory = sandbox_factory
        self._clock = clock or SystemClock()
        # Params and results are validated in these threads, off the loop, joined by ``aclose``.
        self._threads = ThreadPoolExecutor(
            max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="runner-validate"
        )
        executor = Executor(self._clock, audit, self._threads, MCP_WORK)
        asks = api_approver(approver) if approver is not None else None
        self._guard = CallGuard(audit, self._clock, self._threads, executor, self._sandbox, asks)
        self._lock = threading.Lock()
        self._in_flight: set[InFlight] = set()
        self._closed = False
        self._sessions = SessionCounts()  # the open session sandboxes
        # Warm sandboxes for a long-lived runner; a one-shot one (``exec``) would throw them away.
        self._warm_pools = warm_pools
        self._pools = WarmPools(
            audit.operator.warn,
            audit.operator.fault,
            discarded=lambda fields: self.audit.emit("pool.discarded", **fields),
            hosted=MCP_WORK,
            busy=lambda: len(self._in_flight),  # refills wait while calls outnumber the cores
        )
        # Prometheus series, when given; spans whenever a tracer provider is set.
        self.metrics = metrics
        self._telemetry = Telemetry(
            metrics,
            known_tool=lambda name: self.registry.get(name) is not None,
            known_role=lambda role: role in self.policy.model.roles,
        )
        if metrics is not None:
            metrics.watch(self._state)

    @classmethod
    def load(
        cls,
        tools: str | Path | Iterable[str | Path] | None = None,
        policies: str | Path | None = None,
        audit_log: str | Path | None = None,
        *,
        clock: Clock | None = None,
        sandbox_factory: SandboxFactory | None = None,
        warm_pools: bool = True,
        metrics: RunnerMetrics | None = None,
        approver: ApproverFunction | None = None,
    ) -> Runner:
        """Load tools and policy (arguments, then ``RUNNER_*`` variables, then the search of
        ``runner.config.locations``: ``./policies.yaml``, ``~/.config/runner/``, ``/etc/runner/``;
        tools default to ``tools/`` beside the policy file). With ``warm_pools`` the
        policy's pools start filling in the background at once. ``metrics``
        (``runner.telemetry.RunnerMetrics``) receives the runner's Prometheus series. ``approver``
        answers the calls the policy's ``approval:`` holds: ``approver(tool, role, params)``
        returns a bool or an awaitable of one (sensitive params are ``***``).

        Raises:
            ConfigError: the policy file cannot be used, or none was given or found.
        """
        policy_path = find_policy(policies)
        policy = Policy.load(policy_path)
        backends = Backends(policy)
        backends.check_config()
        # A fake factory (the executor's own tests) serves any name: no backend rules then.
        registry = Registry.load(
            tool_dirs(tools, policy_path),
            None if sandbox_factory else backends.manifest_problems,
            lister=ServerLister(policy, sandbox_factory or backends),
        )
        audit_value = audit_log or os.environ.get("RUNNER_AUDIT_LOG")
        audit_path = Path(audit_value) if audit_value else policy.audit_path
        settings = policy.model.audit
        if settings.chain and audit_path is None:
            raise ConfigError(str(policy_path), "audit.chain needs a file: set audit.path or --audit-log")
        # Before anything opens: a keyed chain never goes unkeyed.
        key = policy_chain_key(settings.key, policy.base_dir, policy.source)
        operator = OperatorLog.open(policy.operator_log_path)
        try:
            audit = AuditLog(
                audit_path,
                required=settings.required,
                chain=settings.chain,
                key=key.secret if key is not None else None,
                operator=operator,
            )
        except OSError as exc:
            raise ConfigError(str(audit_path), f"cannot open audit log: {exc.strerror}") from exc
        factory = sandbox_factory or backends
        runner = cls(
            registry, policy, audit, factory, clock, warm_pools=warm_pools, metrics=metrics, approver=approver
        )
        runner._follow_pools()
        return runner

    # -- the Python API -------------------------------------------------------------

    def handle(self, request: object) -> dict[str, Any]:
        """A wire request in, a wire answer out. Never raises for what the request holds.

        Works from any thread, one running an event loop included (see ``call``).

        Raises:
            RuntimeError: the runner is closed.
        """
        return run_blocking(self._serve(request)).to_wire()

    async def ahandle(self, request: object, on_event: EventListener | None = None) -> dict[str, Any]:
        """``handle`` for async code; ``on_event`` as ``call`` has it.

        Raises:
            asyncio.CancelledError: the call was cancelled (its sandbox is gone by then).
            RuntimeError: the runner is closed.
        """
        return (await self._serve(request, on_event)).to_wire()

    def call(
        self,
        tool_name: str,
        params: Mapping[str, Any] | None = None,
        *,
        on_event: EventListener | None = None,
        **options: Any,
    ) -> CallResult:
        """Call a tool; options are ``role``, ``timeout``, ``retries``, ``retry_delay``,
        ``deadline``, ``format``, ``request_id``, ``step_id`` and ``metadata``.
        ``on_event`` gets each event of the tool's (progress, log, content) as it comes.

        Works from any thread. On a thread whose event loop is running (a notebook) the
        call runs on a private loop in a worker thread, joined before returning.

        Raises:
            RuntimeError: the runner is closed.
            asyncio.CancelledError: the runner was closed while the call ran.
        """
        return run_blocking(self._serve(wire_request(tool_name, params, options), on_event))

    async def acall(
        self,
        tool_name: str,
        params: Mapping[str, Any] | None = None,
        *,
        on_event: EventListener | None = None,
        **options: Any,
    ) -> CallResult:
        """``call`` for async code.

        Raises:
            asyncio.CancelledError: the call was cancelled (by its caller, or by closing the
                runner); its sandbox is gone and ``call.finished`` written with
                ``cancelled: true`` before this is raised.
            RuntimeError: the runner is closed.
        """
        return await self._serve(wire_request(tool_name, params, options), on_event)

    def session(self, owner: str | None = None) -> Session:
        """A session (``async with runner.session() as s: await s.acall(...)``); ``owner``:
        the client it counts against for ``session.max_per_token``."""
        settings = lambda: self.policy.model.session  # noqa: E731 - as in force at each look
        return Session(self, CallSession(self._sessions, self.audit, settings, self._clock, owner))

    # -- the lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def aclose(self) -> None:
        """Close the runner; safe to call twice. New calls are refused at once; calls still
        in flight are cancelled (each kills its sandbox, writes ``call.finished`` with
        ``cancelled: true`` and raises ``CancelledError`` to its caller) and waited for; then
        the sessions and backends are closed, the validation threads joined, the audit log closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            calls = [call for call in self._in_flight if not call.loop.is_closed()]
        here = asyncio.get_running_loop()
        for call in calls:
            if call.loop is here:
                call.task.cancel()
            else:
                call.loop.call_soon_threadsafe(call.task.cancel)
        if calls:
            await asyncio.wait([asyncio.wrap_future(call.ended) for call in calls])
        steps = [partial(session.aclose, "runner_closed") for session in list(self._sessions.sessions)]
        steps.append(partial(asyncio.to_thread, self._pools.close))  # every warm sandbox discarded
        if isinstance(self._sandbox_factory, Closable):
            steps.append(self._sandbox_factory.aclose)
        # Idle by now, unless a validation outlived its call (it stops at its next keyword).
        steps.append(partial(asyncio.to_thread, self._threads.shutdown, wait=True))
        try:  # each step, in order, whatever one before raised; the audit log closed on every path
            await finish_shielded(finish_each(steps))
        finally:
            if self.metrics is not None:
                self.metrics.unwatch(self._state)
            self.audit.close()

    def close(self) -> None:
        """``aclose`` for synchronous code (from any thread, see ``call``).

        Raises:
            RuntimeError: this thread runs an event loop with a call of this runner still
                in flight: that call could not end while ``close`` blocks its loop; await
                ``aclose`` there instead.
        """
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        with self._lock:
            stuck = here is not None and any(call.loop is here for call in self._in_flight)
        if stuck:
            raise RuntimeError("a call of this runner runs on this thread's loop: await aclose()")
        run_blocking(self.aclose())

    def discover(self, filter: str | None = None, role: str | None = None) -> list[dict[str, Any]]:
        """The tools ``role`` may call whose name, description or tags contain ``filter``
        (raises ``CallError``, PERMISSION_DENIED, when the role is unknown or missing)."""
        return discovered(self.registry, self.policy, filter, role)

    def reload(self, tools: Iterable[Path], policies: Path) -> None:
        """Serve later calls with the policy and tools as they are now; calls in flight end as
        they began, session sandboxes are opened anew, breakers stay. Raises ``ConfigError``
        (the old ones kept): the policy cannot be used, or changes what only a start reads."""
        policy = Policy.load(policies)
        if changed := policy.read_at_start_changed(self.policy):
            raise ConfigError(str(policies), f"{', '.join(changed)} changed: restart the runner to use it")
        factory = self._sandbox_factory
        registry = Registry.load(
            tools,
            factory.manifest_problems if isinstance(factory, Backends) else None,
            lister=ServerLister(policy, factory),
        )
        with self._lock:
            self.policy, self.registry = policy, registry
            self._sessions.generation = policy.generation = self._sessions.generation + 1

    def tool_definitions(self, format: str, role: str | None = None, *, strict: bool = False) -> list[Any]:
        """The tools ``role`` may call as definitions for an agent, in a format and strictness
        of ``runner.tools.definitions`` (which says what raises ``ValueError``); ``CallError``
        (PERMISSION_DENIED) for an unknown role."""
        return tool_definitions(self.registry, self.policy, format, role, strict=strict)

    def callable_tools(self, role: str | None) -> list[Tool]:
        """The registered tools ``role`` (default: the policy's) may call, by name (raises
        ``CallError``, PERMISSION_DENIED, when the role is unknown or missing)."""
        return callable_tools(self.registry, self.policy, role)

    # -- the call path ----------------------------------------------------------------

    async def _serve(self, raw: object, on_event: EventListener | None = None) -> CallResult:
        with self._served(), self._telemetry.call(raw) as telemetry:
            return await self._answer(raw, telemetry, on_event)

    @contextmanager
    def _served(self) -> Iterator[None]:
        """Keep track of the call being served by the current task, for ``aclose``."""
        call = InFlight(asyncio.get_running_loop(), current_task())
        with self._lock:
            if self._closed:
                raise RuntimeError("this Runner is closed")
            self._in_flight.add(call)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.discard(call)
            call.ended.set_result(None)

    async def _answer(
        self, raw: object, telemetry: CallTelemetry, on_event: EventListener | None
    ) -> CallResult:
        received = self._clock.monotonic()
        trace_id = telemetry.trace_id
        request_id = peek(raw, "requestId", "request_id") or new_request_id()
        tool_name = peek(raw, "toolName", "tool_name")
        role = peek(raw, "role")
        attempts = 0
        extra: dict[str, Any] = {}
        result: Any = None
        error: CallError | None = None
        ctx = CallContext(request_id, trace_id, role, None, None, telemetry=telemetry)
        progress = Progress()
        try:
            try:
                request = parse_request(raw)
            except CallError:
                self._guard.refused_before_policy(tool_name, ctx, "invalid_request")
                raise
            if isinstance(request, DiscoverRequest):
                tools = discovered(self.registry, self.policy, request.options.filter, request.role)
                result = {"tools": tools}
                telemetry.discovering()
                extra["total"] = len(tools)
                tool_name = None
            else:
                policy, guard = self.policy, self._guard  # the policy in force for the whole call
                ctx = call_context(request, request_id, trace_id, policy, telemetry, on_event)
                tool = guard.tool(self.registry, policy, request.tool_name, ctx)
                plan = resolve_plan(tool, policy, request.options)
                # The deadline bounds the whole call, validation of the params included.
                deadline_at = received + plan.deadline_ms / 1000
                check = await guard.check_params(tool, request.params, deadline_at)
                secrets = await guard.read_secrets(tool, policy)
                ctx = replace(
                    ctx, scrubber=check.scrubber.merged(secrets.scrubber), tool_secrets=secrets.scrubber
                )
                execution = await guard.run(
                    tool, request, ctx, plan, check, deadline_at, progress, secrets, policy
                )
                result, error, attempts = execution.result, execution.error, execution.attempts
                if execution.degraded:
                    extra["degraded"] = True
        except CallError as exc:
            error = exc
        except asyncio.CancelledError:
            # Its sandbox is gone by now (teardown is shielded); say so, then go on up.
            self._guard.finished(tool_name, ctx, None, progress.attempts, received, cancelled=True)
            raise
        except Exception as exc:  # handle() never raises: a runner bug still gets the shell
            ids = {"requestId": request_id, "traceId": trace_id, "toolName": tool_name}
            self.audit.operator.fault(exc, ctx.scrubber, **ids)  # the traceback, for the operator only
            error = internal_error(exc)
        if error is not None and ctx.scrubber:
            error = scrubbed(error, ctx.scrubber)
        duration = self._guard.finished(tool_name, ctx, error, attempts, received)
        metadata = AnswerMetadata(duration, attempts, tool_name, iso_now(), request_id, trace_id, extra)
        return CallResult.of(result, error, metadata, progress.content)

    def _follow_pools(self) -> None:
        """Keep the pools of the policy and registry in force (a new one drains the old)."""
        if self._warm_pools:
            self._pools.follow(self.policy, self.registry, self._sandbox_factory, _NO_OPTIONS)

    def _state(self) -> RunnerState:
        """The breakers of the registered tools and the warm pools, for the state gauges."""
        opened = self._guard.open_breakers([tool.name for tool in self.registry])
        return RunnerState(opened, self._pools.counts(), self._pools.takes())

    def warm_sandboxes(self) -> dict[str, int]:
        """Idle warm sandboxes by tool name: the pools as they are now (``pool`` in the policy)."""
        return self._pools.counts()

    def _sandbox(self, tool: Tool, plan: CallPlan, policy: Policy) -> Sandbox:
        """The sandbox a call of ``tool`` runs in: on a Ray node when the policy dispatches
        it, else a warm one from its pool when there is one, else a cold one here."""
        self._follow_pools()
        session = CURRENT.get()
        if session is not None and is_session_tool(tool, policy):
            return session.backend(tool, self._sandbox_factory(plan.sandbox), MCP_WORK, policy.generation)
        return dispatched_sandbox(policy, tool, plan.sandbox) or self._pools.sandbox_for(
            tool.name, self._sandbox_factory(plan.sandbox)
        )
