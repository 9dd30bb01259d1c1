"""``Runner``: the Python API, and the call path in the SPEC's order of checks.

request shape -> tool exists -> policy -> params -> circuit breaker -> execution with
retries -> output parsing. Every path ends in the same answer shell and one
``call.finished`` audit event.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from runner.answers import AnswerMetadata, CallResult, answer
from runner.audit import AuditLog, iso_now
from runner.backends import Backends
from runner.breaker import CircuitBreaker
from runner.clock import Clock, SystemClock
from runner.errors import CallError, ConfigError, ErrorCode
from runner.executor import CallContext, Execution, Executor
from runner.faults import OperatorLog, internal_error
from runner.locations import find_policy, tool_dirs
from runner.manifest import Tool
from runner.models import CallOptions, CallRequest, DiscoverRequest, parse_request, peek
from runner.plan import CallPlan, resolve_plan
from runner.policy import Policy
from runner.redaction import Scrubber, nodes_at, redact_nodes
from runner.registry import Registry, matches_filter
from runner.schemas import VALIDATION_THREADS, ParamsCheck, check_params
from sandboxes import LaunchSpec, Sandbox

SandboxFactory = Callable[[str], Sandbox]
_NO_OPTIONS = CallOptions()
# How long past its budget a validation may take before the call answers without it: a
# validation stops by itself at the next keyword, this covers one slow keyword.
VALIDATION_GRACE_S = 0.05


class Runner:
    """Serves tool calls. Thread-safe; one instance may serve many concurrent calls."""

    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        audit: AuditLog,
        sandbox_factory: SandboxFactory,
        clock: Clock | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.audit = audit
        self._sandbox_factory = sandbox_factory
        self._clock = clock or SystemClock()
        self._executor = Executor(self._clock, audit)
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        tools: str | Path | Iterable[str | Path] | None = None,
        policies: str | Path | None = None,
        audit_log: str | Path | None = None,
        *,
        clock: Clock | None = None,
        sandbox_factory: SandboxFactory | None = None,
    ) -> Runner:
        """Load tools and policy (arguments, then ``RUNNER_*`` variables, then the search of
        ``runner.locations``: ``./policies.yaml``, ``~/.config/runner/``, ``/etc/runner/``;
        tools default to ``tools/`` beside the policy file).

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
        )
        audit_value = audit_log or os.environ.get("RUNNER_AUDIT_LOG")
        audit_path = Path(audit_value) if audit_value else policy.audit_path
        operator = OperatorLog.open(policy.operator_log_path)
        try:
            audit = AuditLog(audit_path, required=policy.model.audit.required, operator=operator)
        except OSError as exc:
            raise ConfigError(str(audit_path), f"cannot open audit log: {exc.strerror}") from exc
        return cls(registry, policy, audit, sandbox_factory or backends, clock)

    # -- the Python API -------------------------------------------------------------

    def handle(self, request: object) -> dict[str, Any]:
        """A wire request in, a wire answer out. Never raises for what the request holds."""
        return asyncio.run(self.ahandle(request))

    def call(self, tool_name: str, params: Mapping[str, Any] | None = None, **options: Any) -> CallResult:
        """Call a tool; options are ``role``, ``timeout``, ``retries``, ``retry_delay``,
        ``deadline``, ``format``, ``request_id``, ``step_id`` and ``metadata``."""
        return CallResult.from_wire(self.handle(_request(tool_name, params, options)))

    async def acall(
        self, tool_name: str, params: Mapping[str, Any] | None = None, **options: Any
    ) -> CallResult:
        return CallResult.from_wire(await self.ahandle(_request(tool_name, params, options)))

    def discover(self, filter: str | None = None, role: str | None = None) -> list[dict[str, Any]]:
        """The tools ``role`` may call whose name, description or tags contain ``filter``.

        Raises:
            CallError: PERMISSION_DENIED when the role is unknown or missing.
        """
        return self._discover(filter, role)

    # -- the call path ----------------------------------------------------------------

    async def ahandle(self, raw: object) -> dict[str, Any]:
        received = self._clock.monotonic()
        trace_id = uuid.uuid4().hex
        request_id = peek(raw, "requestId", "request_id") or _new_request_id()
        tool_name = peek(raw, "toolName", "tool_name")
        role = peek(raw, "role")
        attempts = 0
        extra: dict[str, Any] = {}
        result: Any = None
        error: CallError | None = None
        ctx = CallContext(request_id, trace_id, role, None, None)
        try:
            try:
                request = parse_request(raw)
            except CallError:
                self._refused_before_policy(tool_name, ctx, "invalid_request")
                raise
            if isinstance(request, DiscoverRequest):
                tools = self._discover(request.options.filter, request.role)
                result = {"tools": tools}
                extra["total"] = len(tools)
                tool_name = None
            else:
                ctx = _context(request, request_id, trace_id, self.policy)
                tool = self._tool(request.tool_name, ctx)
                plan = resolve_plan(tool, self.policy, request.options)
                # The deadline bounds the whole call, validation of the params included.
                deadline_at = received + plan.deadline_ms / 1000
                check = await self._check_params(tool, request.params, deadline_at)
                ctx = replace(ctx, scrubber=check.scrubber)
                execution = await self._call(tool, request, ctx, plan, check, deadline_at)
                result, error, attempts = execution.result, execution.error, execution.attempts
                if execution.degraded:
                    extra["degraded"] = True
        except CallError as exc:
            error = exc
        except Exception as exc:  # handle() never raises: a runner bug still gets the shell
            ids = {"requestId": request_id, "traceId": trace_id, "toolName": tool_name}
            self.audit.operator.fault(exc, ctx.scrubber, **ids)  # the traceback, for the operator only
            error = internal_error(exc)
        if error is not None and ctx.scrubber:
            error = _scrubbed(error, ctx.scrubber)
        duration = round((self._clock.monotonic() - received) * 1000)
        self.audit.emit(
            "call.finished",
            ctx.scrubber,
            toolName=tool_name,
            **ctx.audit_fields(),
            success=error is None,
            code=error.code.value if error else None,
            reason=error.reason if error else None,
            attempts=attempts,
            duration=duration,
        )
        metadata = AnswerMetadata(duration, attempts, tool_name, iso_now(), request_id, trace_id, extra)
        return answer(result, error, metadata)

    def _tool(self, name: str, ctx: CallContext) -> Tool:
        tool = self.registry.get(name)
        if tool is None:
            self._refused_before_policy(name, ctx, "tool_not_found")
            raise CallError(
                ErrorCode.TOOL_NOT_FOUND, f"no tool named {name!r} is registered", {"toolName": name}
            )
        return tool

    async def _check_params(self, tool: Tool, params: dict[str, Any], deadline_at: float) -> ParamsCheck:
        """Validate in a worker thread, never on the event loop, within the call's deadline.

        Runs before the policy decision is written, whatever the decision: the decision's
        audit event needs the request's sensitive values, which only validation finds.
        """
        budget_s = max(0.0, deadline_at - self._clock.monotonic())
        work = asyncio.get_running_loop().run_in_executor(
            VALIDATION_THREADS,
            check_params,
            tool.params_validator,
            params,
            tool.sensitive_params,
            budget_s,
        )
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

    async def _call(
        self,
        tool: Tool,
        request: CallRequest,
        ctx: CallContext,
        plan: CallPlan,
        check: ParamsCheck,
        deadline_at: float,
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
                f"role {decision.role!r} may not call {tool.name}: {decision.reason}",
                {"reason": decision.reason, "role": decision.role, "rule": decision.rule},
            )
        if check.expired:
            raise CallError(
                ErrorCode.TIMEOUT,
                f"validating the params of {tool.name} ran past the call's deadline",
                {"deadline": True, "deadlineMs": plan.deadline_ms, "stage": "params"},
            )
        if check.problem is not None:
            raise CallError(
                ErrorCode.INVALID_PARAMS,
                f"invalid params for {tool.name}: {check.problem['field']}: {check.problem['problem']}",
                check.problem,
            )
        breaker = self._breaker(tool.name)
        if not breaker.acquire():
            raise CallError(
                ErrorCode.CIRCUIT_OPEN,
                f"{tool.name} is failing; its circuit breaker is open",
                {"retryAfterMs": breaker.retry_after_ms(), "state": breaker.state.value},
            )
        execution: Execution | None = None
        try:
            sandbox = self._sandbox_factory(plan.sandbox)
            spec = _launch_spec(tool, ctx, self.policy, plan.runtime)
            execution = await self._executor.execute(
                tool, plan, sandbox, spec, request.params, ctx, deadline_at
            )
            return execution
        finally:
            # Only what the tool did counts; a runner fault or a cancelled call gives the
            # half-open probe back instead of blaming the tool.
            if execution is None:
                breaker.release()
            else:
                breaker.record(execution.error is None)

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

    def _breaker(self, name: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._breakers.get(name)
            if breaker is None:
                config = self.policy.model.circuit_breaker
                breaker = CircuitBreaker(
                    config.failure_threshold, config.reset_timeout_ms / 1000, self._clock
                )
                self._breakers[name] = breaker
            return breaker

    def _discover(self, filter_text: str | None, role: str | None) -> list[dict[str, Any]]:
        resolved = self.policy.resolve_role(role)
        if resolved is None or resolved not in self.policy.model.roles:
            reason = "no_role" if resolved is None else "unknown_role"
            raise CallError(
                ErrorCode.PERMISSION_DENIED,
                f"role {resolved!r} may not discover tools: {reason}",
                {"reason": reason, "role": resolved},
            )
        return [
            _describe(tool, self.policy)
            for tool in self.registry
            if matches_filter(tool, filter_text) and self.policy.decide(tool, resolved).allowed
        ]


def _scrubbed(error: CallError, scrubber: Scrubber) -> CallError:
    return CallError(
        error.code,
        scrubber.scrub_text(error.message),
        scrubber.scrub(error.details),
        retryable=error.retryable,
    )


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


def _launch_spec(tool: Tool, ctx: CallContext, policy: Policy, runtime: str | None) -> LaunchSpec:
    manifest = tool.manifest
    env = {**manifest.env, "TOOL_NAME": tool.name, "REQUEST_ID": ctx.request_id}
    return LaunchSpec(
        tool_name=tool.name,
        request_id=ctx.request_id,
        command=tuple(manifest.command),
        tool_dir=tool.directory,
        env=env,
        workspace=policy.workspace if manifest.workspace != "none" else None,
        workspace_mode=manifest.workspace,
        image=manifest.image,
        runtime=runtime,
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
