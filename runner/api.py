"""``Runner``: the Python API, and the call path in the SPEC's order of checks.

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
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from runner.answers import AnswerMetadata, CallResult
from runner.audit import AuditLog, iso_now
from runner.audit_key import policy_chain_key
from runner.backends import Backends
from runner.breaker import BreakerState, CircuitBreaker, CircuitOpen, tool_verdict
from runner.clock import Clock, SystemClock
from runner.dispatch.settings import dispatched_sandbox
from runner.egress import ConnectAttempt, call_egress
from runner.errors import CallError, ConfigError, ErrorCode
from runner.executor import CallContext, Execution, Executor, Progress
from runner.faults import OperatorLog, internal_error
from runner.hosted.listing import ServerLister
from runner.locations import find_policy, tool_dirs
from runner.manifest import Tool
from runner.models import CallOptions, CallRequest, DiscoverRequest, parse_request, peek
from runner.plan import CallPlan, launch_spec, resolve_plan
from runner.policy import Policy
from runner.pools import WarmPools
from runner.redaction import Scrubber, nodes_at, redact_nodes
from runner.registry import Registry, matches_filter
from runner.secrets import NO_SECRET_VALUES, SecretValues, Unavailable, read_secrets
from runner.suggest import did_you_mean
from runner.telemetry.calls import CallTelemetry, Telemetry
from runner.telemetry.labels import CANCELLED, RunnerState
from sandboxes import Closable, Sandbox

if TYPE_CHECKING:
    from runner.schemas import ParamsCheck
    from runner.telemetry.metrics import RunnerMetrics

SandboxFactory = Callable[[str], Sandbox]
T = TypeVar("T")
_NO_OPTIONS = CallOptions()
# How long past its budget a validation may take before the call answers without it: a
# validation stops by itself at the next keyword, this covers one slow keyword.
VALIDATION_GRACE_S = 0.05


@dataclass(eq=False)
class _InFlight:
    """A call being served: the task serving it, on its loop (any thread's)."""

    loop: asyncio.AbstractEventLoop
    task: asyncio.Task[Any]
    # Set when the call has ended, sandbox gone; awaitable from any thread's loop.
    ended: Future[None] = field(default_factory=Future)


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
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.audit = audit
        self._sandbox_factory = sandbox_factory
        self._clock = clock or SystemClock()
        # Params and results are validated in these threads, never on the event loop; they
        # start on first use and are joined by ``aclose``.
        self._threads = ThreadPoolExecutor(
            max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="runner-validate"
        )
        self._executor = Executor(self._clock, audit, self._threads)
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()
        self._in_flight: set[_InFlight] = set()
        self._closed = False
        # Warm sandboxes (SPEC 11) for a long-lived runner; a one-shot one (the CLI's
        # ``exec``) would start them only to throw them away.
        self._warm_pools = warm_pools
        self._pools = WarmPools(
            audit.operator.warn,
            audit.operator.fault,
            discarded=lambda fields: self.audit.emit("pool.discarded", **fields),
        )
        # Prometheus series (SPEC 13), when given; spans whenever a tracer provider is set.
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
    ) -> Runner:
        """Load tools and policy (arguments, then ``RUNNER_*`` variables, then the search of
        ``runner.locations``: ``./policies.yaml``, ``~/.config/runner/``, ``/etc/runner/``;
        tools default to ``tools/`` beside the policy file). With ``warm_pools`` the
        policy's pools (SPEC 11) start filling in the background at once. ``metrics``
        (``runner.telemetry.RunnerMetrics``) receives the runner's Prometheus series.

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
        key = policy_chain_key(policy)  # before anything opens: a keyed chain never goes unkeyed
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
        runner = cls(registry, policy, audit, factory, clock, warm_pools=warm_pools, metrics=metrics)
        runner._follow_pools()
        return runner

    # -- the Python API -------------------------------------------------------------

    def handle(self, request: object) -> dict[str, Any]:
        """A wire request in, a wire answer out. Never raises for what the request holds.

        Works from any thread, one running an event loop included (see ``call``).

        Raises:
            RuntimeError: the runner is closed.
        """
        return _run_blocking(self._serve(request)).to_wire()

    async def ahandle(self, request: object) -> dict[str, Any]:
        """``handle`` for async code.

        Raises:
            asyncio.CancelledError: the call was cancelled (its sandbox is gone by then).
            RuntimeError: the runner is closed.
        """
        return (await self._serve(request)).to_wire()

    def call(self, tool_name: str, params: Mapping[str, Any] | None = None, **options: Any) -> CallResult:
        """Call a tool; options are ``role``, ``timeout``, ``retries``, ``retry_delay``,
        ``deadline``, ``format``, ``request_id``, ``step_id`` and ``metadata``.

        Works from any thread. On a thread whose event loop is running (a notebook) the
        call runs on a private loop in a worker thread, joined before returning.

        Raises:
            RuntimeError: the runner is closed.
            asyncio.CancelledError: the runner was closed while the call ran.
        """
        return _run_blocking(self._serve(_request(tool_name, params, options)))

    async def acall(
        self, tool_name: str, params: Mapping[str, Any] | None = None, **options: Any
    ) -> CallResult:
        """``call`` for async code.

        Raises:
            asyncio.CancelledError: the call was cancelled (by its caller, or by closing the
                runner); its sandbox is gone and ``call.finished`` written with
                ``cancelled: true`` before this is raised.
            RuntimeError: the runner is closed.
        """
        return await self._serve(_request(tool_name, params, options))

    # -- the lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __enter__(self) -> Runner:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def aclose(self) -> None:
        """Close the runner; safe to call twice. New calls are refused at once; calls
        still in flight are cancelled (each kills its sandbox, writes ``call.finished``
        with ``cancelled: true`` and raises ``CancelledError`` to its caller) and waited
        for; then the backends are closed (no sandbox of theirs is left), the validation
        threads joined and the audit log closed.
        """
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
        await asyncio.to_thread(self._pools.close)  # every warm sandbox discarded
        if isinstance(self._sandbox_factory, Closable):
            await self._sandbox_factory.aclose()
        # Idle by now (every call has ended), unless a validation outlived its call's answer:
        # it stops at its next keyword. Joined off the loop all the same.
        await asyncio.to_thread(self._threads.shutdown, wait=True)
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
        _run_blocking(self.aclose())

    def discover(self, filter: str | None = None, role: str | None = None) -> list[dict[str, Any]]:
        """The tools ``role`` may call whose name, description or tags contain ``filter``.

        Raises:
            CallError: PERMISSION_DENIED when the role is unknown or missing.
        """
        return self._discover(filter, role)

    def reload(self, tools: Iterable[Path], policies: Path) -> None:
        """Serve later calls with the policy file and tool folders as they are now (``runner
        serve`` on a change); calls in flight finish with what they started with, and the
        circuit breakers stay. Backend settings and the audit log are not reloaded.

        Raises:
            ConfigError: the policy file cannot be used; the runner keeps the old one.
        """
        policy = Policy.load(policies)
        factory = self._sandbox_factory
        registry = Registry.load(
            tools,
            factory.manifest_problems if isinstance(factory, Backends) else None,
            lister=ServerLister(policy, factory),
        )
        with self._lock:
            self.policy, self.registry = policy, registry

    def tool_definitions(self, format: str, role: str | None = None) -> list[dict[str, Any]]:
        """The tools ``role`` may call as definitions for an agent: ``openai``, ``anthropic``
        or ``mcp`` (SPEC 10; ``runner.serve.definitions`` says what each format leaves out).

        Raises:
            ValueError: ``format`` is not one of those.
            CallError: PERMISSION_DENIED when the role is unknown or missing.
        """
        from runner.serve.definitions import definitions

        return definitions(self.callable_tools(role), format).tools

    def callable_tools(self, role: str | None) -> list[Tool]:
        """The registered tools ``role`` (default: the policy's) may call, by name.

        Raises:
            CallError: PERMISSION_DENIED when the role is unknown or missing.
        """
        resolved = self.policy.resolve_role(role)
        if resolved is None or resolved not in self.policy.model.roles:
            reason = "no_role" if resolved is None else "unknown_role"
            raise CallError(
                ErrorCode.PERMISSION_DENIED,
                f"{_caller(resolved)} may not discover tools: {reason}",
                {"reason": reason, "role": resolved},
            )
        return [tool for tool in self.registry if self.policy.decide(tool, resolved).allowed]

    # -- the call path ----------------------------------------------------------------

    async def _serve(self, raw: object) -> CallResult:
        with self._served(), self._telemetry.call(raw) as telemetry:
            return await self._answer(raw, telemetry)

    @contextmanager
    def _served(self) -> Iterator[None]:
        """Keep track of the call being served by the current task, for ``aclose``."""
        call = _InFlight(asyncio.get_running_loop(), _current_task())
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

    async def _answer(self, raw: object, telemetry: CallTelemetry) -> CallResult:
        received = self._clock.monotonic()
        trace_id = telemetry.trace_id
        request_id = peek(raw, "requestId", "request_id") or _new_request_id()
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
                self._refused_before_policy(tool_name, ctx, "invalid_request")
                raise
            if isinstance(request, DiscoverRequest):
                tools = self._discover(request.options.filter, request.role)
                result = {"tools": tools}
                telemetry.discovering()
                extra["total"] = len(tools)
                tool_name = None
            else:
                ctx = replace(_context(request, request_id, trace_id, self.policy), telemetry=telemetry)
                tool = self._tool(request.tool_name, ctx)
                plan = resolve_plan(tool, self.policy, request.options)
                # The deadline bounds the whole call, validation of the params included.
                deadline_at = received + plan.deadline_ms / 1000
                check = await self._check_params(tool, request.params, deadline_at)
                secrets = await self._read_secrets(tool)
                ctx = replace(
                    ctx, scrubber=check.scrubber.merged(secrets.scrubber), tool_secrets=secrets.scrubber
                )
                execution = await self._call(tool, request, ctx, plan, check, deadline_at, progress, secrets)
                result, error, attempts = execution.result, execution.error, execution.attempts
                if execution.degraded:
                    extra["degraded"] = True
        except CallError as exc:
            error = exc
        except asyncio.CancelledError:
            # Its sandbox is gone by now (teardown is shielded); say so, then go on up.
            self._finished(tool_name, ctx, None, progress.attempts, received, cancelled=True)
            raise
        except Exception as exc:  # handle() never raises: a runner bug still gets the shell
            ids = {"requestId": request_id, "traceId": trace_id, "toolName": tool_name}
            self.audit.operator.fault(exc, ctx.scrubber, **ids)  # the traceback, for the operator only
            error = internal_error(exc)
        if error is not None and ctx.scrubber:
            error = _scrubbed(error, ctx.scrubber)
        duration = self._finished(tool_name, ctx, error, attempts, received)
        metadata = AnswerMetadata(duration, attempts, tool_name, iso_now(), request_id, trace_id, extra)
        return CallResult.of(result, error, metadata)

    def _finished(
        self,
        tool_name: str | None,
        ctx: CallContext,
        error: CallError | None,
        attempts: int,
        received: float,
        *,
        cancelled: bool = False,
    ) -> int:
        """Write the call's ``call.finished`` event; its duration in ms."""
        elapsed = self._clock.monotonic() - received
        duration = round(elapsed * 1000)
        outcome: dict[str, Any] = {"cancelled": True} if cancelled else {}
        self.audit.emit(
            "call.finished",
            ctx.scrubber,
            toolName=tool_name,
            **ctx.audit_fields(),
            success=error is None and not cancelled,
            code=error.code.value if error else None,
            reason=error.reason if error else None,
            attempts=attempts,
            duration=duration,
            **outcome,
        )
        code = CANCELLED if cancelled else error.code.value if error else None
        ctx.telemetry.finished(tool_name, ctx.role, code, attempts, elapsed)
        return duration

    def _tool(self, name: str, ctx: CallContext) -> Tool:
        tool = self.registry.get(name)
        if tool is None:
            self._refused_before_policy(name, ctx, "tool_not_found")
            if self.registry.left_out(name):
                raise CallError(
                    ErrorCode.TOOL_NOT_FOUND,
                    f"tool {name!r} is not registered: its manifest is invalid (runner validate says why)",
                    {"toolName": name, "reason": "invalid_manifest"},
                )
            hint = did_you_mean(name, self._callable_names(ctx.role))
            raise CallError(
                ErrorCode.TOOL_NOT_FOUND, f"no tool named {name!r} is registered{hint}", {"toolName": name}
            )
        return tool

    def _callable_names(self, role: str | None) -> list[str]:
        """The tools ``role`` may call: the only names a refusal may suggest to it."""
        policy = self.policy
        return [tool.name for tool in self.registry if policy.decide(tool, role).allowed]

    async def _check_params(self, tool: Tool, params: dict[str, Any], deadline_at: float) -> ParamsCheck:
        """Validate in a worker thread, never on the event loop, within the call's deadline.

        Runs before the policy decision is written, whatever the decision: the decision's
        audit event needs the request's sensitive values, which only validation finds.
        """
        from runner.schemas import ParamsCheck, check_params  # jsonschema: only once a call needs it

        budget_s = max(0.0, deadline_at - self._clock.monotonic())

        def check() -> ParamsCheck:
            # In the thread: a tool's first call builds its validator (lazily, see Tool).
            return check_params(tool.params_validator, params, tool.sensitive_params, budget_s)

        work = asyncio.get_running_loop().run_in_executor(self._threads, check)
        try:
            # The thread itself stops at the next keyword past its budget; this bounds a
            # single slow keyword too.
            return await asyncio.wait_for(work, budget_s + VALIDATION_GRACE_S)
        except TimeoutError:
            static = nodes_at(params, tool.sensitive_params)
            return ParamsCheck(
                problem=None,
                expired=True,
                scrubber=Scrubber.of(static),
                audit_params=redact_nodes(params, frozenset(id(node) for node in static)),
            )

    async def _read_secrets(self, tool: Tool) -> SecretValues:
        """The values of the secrets the policy grants ``tool``, read off the event loop."""
        names = self.policy.granted_secrets(tool)
        if not names:
            return NO_SECRET_VALUES
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, read_secrets, names, self.policy.model.secrets, self.policy.base_dir
        )

    async def _call(
        self,
        tool: Tool,
        request: CallRequest,
        ctx: CallContext,
        plan: CallPlan,
        check: ParamsCheck,
        deadline_at: float,
        progress: Progress,
        secrets: SecretValues,
    ) -> Execution:
        decision = self.policy.decide(tool, request.role)
        self.audit.emit(
            "policy.decision",
            ctx.scrubber,
            toolName=tool.name,
            **ctx.audit_fields(),
            decision="allow" if decision.allowed else "deny",
            reason=decision.reason,
            rule=decision.rule,
            params=check.audit_params,
        )
        if not decision.allowed:
            raise CallError(
                ErrorCode.PERMISSION_DENIED,
                f"{_caller(decision.role)} may not call {tool.name}: {decision.reason}",
                {"reason": decision.reason, "role": decision.role, "rule": decision.rule},
            )
        if check.expired:
            raise CallError(
                ErrorCode.TIMEOUT,
                f"validating the params of {tool.name} ran past the call's deadline",
                {"deadline": True, "deadlineMs": plan.deadline_ms, "stage": "params"},
            )
        if check.problem is not None:
            more = len(check.problem.get("errors", ())) - 1 + check.problem.get("moreErrors", 0)
            also = f" (and {more} more: details.errors lists them)" if more > 0 else ""
            raise CallError(
                ErrorCode.INVALID_PARAMS,
                f"invalid params for {tool.name}: {check.problem['field']}: {check.problem['problem']}{also}",
                check.problem,
            )
        try:
            # Only what the tool did counts: a runner fault or a cancelled call leaves the
            # block without a verdict, which hands a half-open probe back.
            with self._breaker(tool.name).guard(ends_by=deadline_at) as ticket:
                if secrets.missing:
                    raise self._secret_unavailable(tool, secrets.missing[0])
                self._follow_pools()
                # A tool the policy dispatches (SPEC 14) runs on a Ray node; any other here.
                sandbox = dispatched_sandbox(self.policy, tool, plan.sandbox) or self._pools.sandbox_for(
                    tool.name, self._sandbox_factory(plan.sandbox)
                )
                sandbox = ctx.telemetry.timed(sandbox)
                spec = launch_spec(tool, ctx.request_id, self.policy, plan.runtime)
                spec = replace(spec, secrets=secrets.values)
                report = self._network_reporter(tool, ctx)
                async with call_egress(tool, self.policy, spec, report) as spec:
                    execution = await self._executor.execute(
                        tool, plan, sandbox, spec, request.params, ctx, deadline_at, progress
                    )
                ticket.record(tool_verdict(execution.error))
                return execution
        except CircuitOpen as refused:
            raise CallError(
                ErrorCode.CIRCUIT_OPEN,
                f"{tool.name} is failing; its circuit breaker is {refused.state.value}",
                {"retryAfterMs": refused.retry_after_ms, "state": refused.state.value},
            ) from None

    def _follow_pools(self) -> None:
        """Keep the pools of the policy and registry in force (a new one drains the old)."""
        if self._warm_pools:
            self._pools.follow(self.policy, self.registry, self._sandbox_factory, _NO_OPTIONS)

    def _network_reporter(self, tool: Tool, ctx: CallContext) -> Callable[[ConnectAttempt], None]:
        """Each connection the call's egress proxy opens or refuses, as an audit event."""

        def report(attempt: ConnectAttempt) -> None:
            fields = {**ctx.audit_fields(), **attempt.audit_fields()}
            self.audit.emit("network.connect", ctx.scrubber, toolName=tool.name, **fields)

        return report

    def _secret_unavailable(self, tool: Tool, missing: Unavailable) -> CallError:
        """The error of a granted secret without a value here; the operator is told where."""
        self.audit.operator.warn(f"secret {missing.name} of {tool.name} has no value: {missing.for_operator}")
        return CallError(
            ErrorCode.EXECUTION_ERROR,
            f"secret {missing.name} of {tool.name} has no value on this host: {missing.told}",
            {"reason": "secret_unavailable", "secret": missing.name},
            retryable=False,
        )

    def _refused_before_policy(self, tool_name: str | None, ctx: CallContext, reason: str) -> None:
        """Calls that never reach the policy still get their one (deny) decision event."""
        self.audit.emit(
            "policy.decision",
            toolName=tool_name,
            **ctx.audit_fields(),
            decision="deny",
            reason=reason,
            rule=None,
        )

    def _state(self) -> RunnerState:
        """The breakers of the registered tools and the warm pools, for the state gauges."""
        with self._lock:
            breakers = dict(self._breakers)
        opened = {
            tool.name: tool.name in breakers and breakers[tool.name].state is not BreakerState.CLOSED
            for tool in self.registry
        }
        return RunnerState(opened, self._pools.counts())

    def _breaker(self, name: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._breakers.get(name)
            if breaker is None:
                config = self.policy.model.circuit_breaker
                breaker = CircuitBreaker(
                    config.failure_threshold,
                    config.reset_timeout_ms / 1000,
                    self._clock,
                    on_open=lambda failures: self.audit.emit(
                        "breaker.opened", toolName=name, failures=failures
                    ),
                )
                self._breakers[name] = breaker
            return breaker

    def _discover(self, filter_text: str | None, role: str | None) -> list[dict[str, Any]]:
        return [
            _describe(tool, self.policy)
            for tool in self.callable_tools(role)
            if matches_filter(tool, filter_text)
        ]


def _caller(role: str | None) -> str:
    """Who a refused call was made as, in words: a missing role is not ``None`` to a user."""
    return "a call naming no role (and the policy has no default_role)" if role is None else f"role {role!r}"


def _scrubbed(error: CallError, scrubber: Scrubber) -> CallError:
    return CallError(
        error.code,
        scrubber.scrub_text(error.message),
        scrubber.scrub(error.details),
        retryable=error.retryable,
    )


def _current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:  # only a bare coroutine driven by hand has none
        raise RuntimeError("Runner calls must run in an asyncio task")
    return task


def _run_blocking(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end from synchronous code: on a fresh event loop, or, when this
    thread already runs one (a notebook), on a private loop in a worker thread joined
    before returning (``asyncio.run`` refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    done: Future[T] = Future()

    def serve() -> None:
        try:
            done.set_result(asyncio.run(work))
        except BaseException as exc:  # handed to the caller's thread as is
            done.set_exception(exc)

    worker = threading.Thread(target=serve, name="runner-call")
    worker.start()
    worker.join()
    return done.result()


def _new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def _request(tool_name: str, params: Mapping[str, Any] | None, options: dict[str, Any]) -> dict[str, Any]:
    request: dict[str, Any] = {"toolName": tool_name, "params": dict(params or {})}
    wire_options = {
        k: options.pop(k) for k in ("timeout", "retries", "retry_delay", "deadline", "format") if k in options
    }
    if wire_options:
        request["options"] = wire_options
    request.update(options)
    return request


def _context(request: CallRequest, request_id: str, trace_id: str, policy: Policy) -> CallContext:
    user_id = request.metadata.get("userId")
    return CallContext(
        request_id=request_id,
        trace_id=trace_id,
        role=policy.resolve_role(request.role),
        step_id=request.step_id,
        user_id=str(user_id) if user_id is not None else None,
    )


def _describe(tool: Tool, policy: Policy) -> dict[str, Any]:
    manifest = tool.manifest
    limits = resolve_plan(tool, policy, _NO_OPTIONS).limits
    return {
        "name": manifest.name,
        "description": manifest.description,
        "paramsSchema": manifest.parameters,
        "metadata": {
            "tags": manifest.tags,
            "version": manifest.version,
            "sandbox": manifest.sandbox,
            "limits": {
                "timeoutMs": limits.timeout_ms,
                "memoryMb": limits.memory_mb,
                "cpuSeconds": limits.cpu_seconds,
                "maxPids": limits.max_pids,
                "maxOutputBytes": limits.max_output_bytes,
                "diskMb": limits.disk_mb,
                "network": limits.network,
            },
        },
    }
