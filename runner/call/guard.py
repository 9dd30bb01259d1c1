"""The guard of one call, once its request is read: tool, params, secrets, policy,
breaker, then the sandbox and the attempts. Each stage answers with a ``CallError`` (and
its audit event) or hands on; the ``Runner`` reads the request, composes the sandbox a
tool runs in (dispatched or pooled, timed) and writes the answer.

Policy and registry are the ones in force when the call was read: a reload during the
call does not change them under it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from runner.audit.log import AuditLog
from runner.call.approval import ApprovalGate, Approver
from runner.call.breaker import BreakerState, CircuitBreaker, CircuitOpen, tool_verdict
from runner.call.egress import ConnectAttempt, call_egress
from runner.call.events import EventListener
from runner.call.executor import CallContext, Execution, Executor, Progress
from runner.call.hooks import CANCELLED, NO_HOOKS, CallHooks
from runner.call.plan import CallPlan, launch_spec
from runner.call.policy import Policy
from runner.call.pool_calls import PoolingSandbox
from runner.call.requests import CallRequest
from runner.clock import Clock
from runner.errors import CallError, ErrorCode
from runner.schema.inline import is_light
from runner.schema.redaction import REDACTED, Scrubber, nodes_at
from runner.schema.suggest import did_you_mean
from runner.secrets.sources import NO_SECRET_VALUES, SecretValues, Unavailable, read_secrets
from runner.tools.manifest import Tool
from runner.tools.registry import Registry
from sandboxes import Sandbox

if TYPE_CHECKING:
    from runner.schema.compiled import ParamsCheck

# How long past its budget a validation may take before the call answers without it: a
# validation stops by itself at the next keyword, this covers one slow keyword.
VALIDATION_GRACE_S = 0.05
# The sandbox a call of a tool runs in, under the call's plan and policy.
SandboxFor = Callable[[Tool, CallPlan, Policy], Sandbox]


class CallGuard:
    """The stages of a call after its request; one per runner, shared by its calls."""

    def __init__(
        self,
        audit: AuditLog,
        clock: Clock,
        threads: ThreadPoolExecutor,
        executor: Executor,
        sandbox_for: SandboxFor,
        approver: Approver | None = None,
    ) -> None:
        self.audit = audit
        self._approval = ApprovalGate(audit, clock, approver)
        self._clock = clock
        self._threads = threads  # params are validated and secrets read here, off the loop
        self._executor = executor
        self._sandbox_for = sandbox_for
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()

    def finished(
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

    def tool(self, registry: Registry, policy: Policy, name: str, ctx: CallContext) -> Tool:
        """The tool a call names; TOOL_NOT_FOUND (and a deny event) when there is none,
        with the closest names among those the caller's role may call."""
        tool = registry.get(name)
        if tool is None:
            self.refused_before_policy(name, ctx, "tool_not_found")
            if registry.left_out(name):
                raise CallError(
                    ErrorCode.TOOL_NOT_FOUND,
                    f"tool {name!r} is not registered: its manifest is invalid (runner validate says why)",
                    {"toolName": name, "reason": "invalid_manifest"},
                )
            callable_names = [tool.name for tool in registry if policy.decide(tool, ctx.role).allowed]
            hint = did_you_mean(name, callable_names)
            raise CallError(
                ErrorCode.TOOL_NOT_FOUND, f"no tool named {name!r} is registered{hint}", {"toolName": name}
            )
        return tool

    async def check_params(self, tool: Tool, params: dict[str, Any], deadline_at: float) -> ParamsCheck:
        """Validate in a worker thread within the call's deadline; on the event loop only
        light params of a linear schema (``runner.schema.inline``).

        Runs before the policy decision is written, whatever the decision: the decision's
        audit event needs the request's sensitive values, which only validation finds.
        """
        from runner.schema.compiled import ParamsCheck, check_params  # jsonschema: only once a call needs it

        budget_s = max(0.0, deadline_at - self._clock.monotonic())

        def check() -> ParamsCheck:
            # A tool's first call builds its validator (lazily, see Tool).
            return check_params(tool.params_validator, params, tool.sensitive_params, budget_s)

        if tool.params_linear and is_light(params):
            # Microseconds: less than the hop to a thread and back (``runner.schema.inline``).
            return check()
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
                params=params,
                audit_params=REDACTED,  # the validation may not have reached every sensitive value
            )

    async def read_secrets(self, tool: Tool, policy: Policy) -> SecretValues:
        """The values of the secrets the policy grants ``tool``, read off the event loop."""
        names = policy.granted_secrets(tool)
        if not names:
            return NO_SECRET_VALUES
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, read_secrets, names, policy.model.secrets, policy.base_dir
        )

    async def run(
        self,
        tool: Tool,
        request: CallRequest,
        ctx: CallContext,
        plan: CallPlan,
        check: ParamsCheck,
        deadline_at: float,
        progress: Progress,
        secrets: SecretValues,
        policy: Policy,
    ) -> Execution:
        """Policy, then the params' verdict, then a person's approval if the policy wants
        one, then the breaker; then the sandbox and the attempts."""
        decision = policy.decide(tool, request.role)
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
                f"{caller(decision.role)} may not call {tool.name}: {decision.reason}",
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
        if (approval := policy.approval_for(tool, decision.role)) is not None:
            # The wait for a person is not the call's time: the deadline moves by it.
            deadline_at += await self._approval.wait(tool.name, ctx, check.audit_params, approval.timeout_ms)
        try:
            # Only what the tool did counts: a runner fault or a cancelled call leaves the
            # block without a verdict, which hands a half-open probe back.
            with self.breaker(tool.name, policy).guard(ends_by=deadline_at) as ticket:
                if secrets.missing:
                    raise self._unavailable(tool, secrets.missing[0])
                chosen = self._sandbox_for(tool, plan, policy)
                sandbox = ctx.telemetry.timed(chosen)
                spec = launch_spec(tool, ctx.request_id, policy, plan.runtime)
                spec = replace(spec, secrets=secrets.values)
                report = self._reporter(tool, ctx)
                async with call_egress(tool, policy, spec, report) as spec:
                    execution = await self._executor.execute(
                        tool,
                        plan,
                        sandbox,
                        spec,
                        check.params,
                        ctx,
                        deadline_at,
                        progress,
                        pooled=isinstance(chosen, PoolingSandbox),
                    )
                ticket.record(tool_verdict(execution.error))
                return execution
        except CircuitOpen as refused:
            raise CallError(
                ErrorCode.CIRCUIT_OPEN,
                f"{tool.name} is failing; its circuit breaker is {refused.state.value}",
                {"retryAfterMs": refused.retry_after_ms, "state": refused.state.value},
            ) from None

    def _reporter(self, tool: Tool, ctx: CallContext) -> Callable[[ConnectAttempt], None]:
        """Each connection the call's egress proxy opens or refuses, as an audit event."""

        def report(attempt: ConnectAttempt) -> None:
            fields = {**ctx.audit_fields(), **attempt.audit_fields()}
            self.audit.emit("network.connect", ctx.scrubber, toolName=tool.name, **fields)

        return report

    def _unavailable(self, tool: Tool, missing: Unavailable) -> CallError:
        """The error of a granted secret without a value here; the operator is told where."""
        self.audit.operator.warn(f"secret {missing.name} of {tool.name} has no value: {missing.for_operator}")
        return CallError(
            ErrorCode.EXECUTION_ERROR,
            f"secret {missing.name} of {tool.name} has no value on this host: {missing.told}",
            {"reason": "secret_unavailable", "secret": missing.name},
            retryable=False,
        )

    def refused_before_policy(self, tool_name: str | None, ctx: CallContext, reason: str) -> None:
        """Calls that never reach the policy still get their one (deny) decision event."""
        self.audit.emit(
            "policy.decision",
            toolName=tool_name,
            **ctx.audit_fields(),
            decision="deny",
            reason=reason,
            rule=None,
        )

    def breaker(self, name: str, policy: Policy) -> CircuitBreaker:
        """The breaker of tool ``name``, made on first use with the policy's settings."""
        with self._lock:
            breaker = self._breakers.get(name)
            if breaker is None:
                config = policy.model.circuit_breaker
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

    def open_breakers(self, names: list[str]) -> dict[str, bool]:
        """For each of ``names``: is its breaker open or half-open?"""
        with self._lock:
            breakers = dict(self._breakers)
        return {name: name in breakers and breakers[name].state is not BreakerState.CLOSED for name in names}


def caller(role: str | None) -> str:
    """Who a refused call was made as, in words: a missing role is not ``None`` to a user."""
    return "a call naming no role (and the policy has no default_role)" if role is None else f"role {role!r}"


def call_context(
    request: CallRequest,
    request_id: str,
    trace_id: str,
    policy: Policy,
    telemetry: CallHooks = NO_HOOKS,
    on_event: EventListener | None = None,
) -> CallContext:
    user_id = request.metadata.get("userId")
    return CallContext(
        request_id=request_id,
        trace_id=trace_id,
        role=policy.resolve_role(request.role),
        step_id=request.step_id,
        user_id=str(user_id) if user_id is not None else None,
        telemetry=telemetry,
        on_event=on_event,
    )


def scrubbed(error: CallError, scrubber: Scrubber) -> CallError:
    return CallError(
        error.code,
        scrubber.scrub_text(error.message),
        scrubber.scrub(error.details),
        retryable=error.retryable,
    )
