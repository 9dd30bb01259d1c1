"""Running one call's attempts: retries with delay inside a deadline.

The executor knows nothing of which backend it drives: it gets a ``Sandbox`` and asks it
to prepare, run and close, once per attempt.
"""

from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import Executor as ThreadPool
from dataclasses import dataclass, replace
from typing import Any, Literal

from runner.audit.log import AuditLog
from runner.call.events import EventListener, ToolEvents
from runner.call.hooks import NO_HOOKS, CallHooks
from runner.call.hosting import NO_HOSTED_WORK, HostedWork
from runner.call.outcomes import failure_error, parse_result
from runner.call.plan import CallPlan
from runner.clock import Clock
from runner.errors import CallError, ErrorCode
from runner.schema.redaction import NO_SECRETS, Scrubber
from runner.secrets.output import scrub_outcome
from runner.tools.manifest import Tool
from sandboxes import (
    Converses,
    Dialogue,
    LaunchSpec,
    Limits,
    PreparedSandbox,
    Sandbox,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
    WorkspaceNotApplied,
)
from sandboxes.cancellation import finish_shielded
from sandboxes.events import EventSink, StreamsEvents

# An attempt with less time than this left before the deadline is not worth starting:
# it could not even spawn a process.
MIN_ATTEMPT_MS = 10
# A result this short, with no output_schema or a linear one (``runner.schema.inline``),
# is parsed and checked on the event loop: tens of microseconds at most, less than the
# hop to a thread and back.
INLINE_PARSE_BYTES = 4096


@dataclass(frozen=True)
class CallContext:
    """Who and what a call is, for its audit events; ``scrubber`` holds every sensitive
    string of the call, ``tool_secrets`` the values of the secrets its tool was given,
    ``telemetry`` its metrics and spans."""

    request_id: str
    trace_id: str
    role: str | None
    step_id: str | None
    user_id: str | None
    scrubber: Scrubber = NO_SECRETS
    tool_secrets: Scrubber = NO_SECRETS
    telemetry: CallHooks = NO_HOOKS
    # Gets each event of the tool's as it arrives (``runner.call.events``).
    on_event: EventListener | None = None

    def audit_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "requestId": self.request_id,
            "traceId": self.trace_id,
            "role": self.role,
        }
        if self.step_id is not None:
            fields["stepId"] = self.step_id
        if self.user_id is not None:
            fields["userId"] = self.user_id
        return fields


@dataclass(frozen=True)
class Execution:
    """How a call's execution ended: a result, or the final error; attempts started."""

    result: Any
    error: CallError | None
    attempts: int
    degraded: bool = False


@dataclass
class Progress:
    """How far a call's execution got: what its ``call.finished`` says if it is cancelled;
    the content blocks the tool attached to its result (``runner.call.events``)."""

    attempts: int = 0
    degraded: bool = False
    content: tuple[dict[str, Any], ...] = ()


def final_error(errors: list[CallError]) -> CallError:
    """The final-code rule: one attempt keeps its code; several give TIMEOUT or RETRY_EXHAUSTED."""
    last = errors[-1]
    if len(errors) == 1 or last.code is ErrorCode.TIMEOUT:
        return last
    return CallError(
        ErrorCode.RETRY_EXHAUSTED,
        f"all {len(errors)} attempts failed; last: {last.message}",
        {"lastError": last.to_wire(), "attempts": len(errors)},
        retryable=last.retryable,  # come back later exactly when the last failure allows it
    )


class Executor:
    def __init__(
        self, clock: Clock, audit: AuditLog, threads: ThreadPool, hosted: HostedWork = NO_HOSTED_WORK
    ) -> None:
        self._clock = clock
        self._audit = audit
        self._threads = threads  # long results and output_schema: never on the event loop
        self._hosted = hosted  # a hosted MCP server's tool is spoken with through this

    async def execute(
        self,
        tool: Tool,
        plan: CallPlan,
        sandbox: Sandbox,
        spec: LaunchSpec,
        params: dict[str, Any],
        ctx: CallContext,
        deadline_at: float | None = None,
        progress: Progress | None = None,
        pooled: bool = False,
    ) -> Execution:
        """Run the attempts; the deadline is ``deadline_at`` (clock time) if given, else
        ``plan.deadline_ms`` from now. ``progress`` follows the attempts as they start.
        ``pooled``: the tool has a warm pool (its attempts' events say hit or miss).

        Raises:
            asyncio.CancelledError: the call was cancelled; its sandbox is gone by then
                and the attempt it cut short has its ``call.attempt`` event.
        """
        clock = self._clock
        if deadline_at is None:
            deadline_at = clock.monotonic() + plan.deadline_ms / 1000
        progress = progress or Progress()
        errors: list[CallError] = []
        for attempt in range(1, plan.retries + 2):
            left_ms = (deadline_at - clock.monotonic()) * 1000
            if attempt > 1 and left_ms < MIN_ATTEMPT_MS:
                break
            timeout_ms = max(1, min(plan.limits.timeout_ms, math.ceil(left_ms)))
            by_deadline = timeout_ms < plan.limits.timeout_ms
            # A hosted MCP server's tool is spoken with; any other is fed its payload.
            events = ToolEvents(ctx.scrubber, ctx.on_event)
            dialogue = (
                self._hosted.dialogue(tool.hosted.tool, params, ctx.tool_secrets, events)
                if tool.hosted is not None
                else None
            )
            work = dialogue if dialogue is not None else _payload(params, spec, attempt)
            started = clock.monotonic()
            progress.attempts = attempt
            ctx.telemetry.attempt_started(tool.name, sandbox.name)
            limits = replace(plan.limits, timeout_ms=timeout_ms)
            try:
                outcome = await run_attempt(sandbox, spec, limits, work, events)
            except asyncio.CancelledError:
                self._cancelled_event(tool, ctx, attempt, sandbox, started)
                raise
            progress.degraded = progress.degraded or outcome.degraded
            if dialogue is not None:
                outcome = dialogue.settled(outcome)
            if ctx.tool_secrets:  # before anything reads the outcome, cuts it short or logs it
                outcome = await asyncio.get_running_loop().run_in_executor(
                    self._threads, scrub_outcome, outcome, ctx.tool_secrets, plan.format
                )
            try:
                if dialogue is not None and (broken := dialogue.protocol_error(tool.name, ctx.tool_secrets)):
                    raise broken
                if not outcome.ok:
                    raise failure_error(tool, outcome, timeout_ms, by_deadline)
                result = await self._parse(tool, outcome.stdout, plan.format)
            except CallError as error:
                errors.append(error)
                self._attempt_event(tool, ctx, attempt, sandbox, outcome, started, error, pooled, events)
            else:
                self._attempt_event(tool, ctx, attempt, sandbox, outcome, started, None, pooled, events)
                progress.content = tuple(events.content)
                return Execution(result, None, attempt, progress.degraded)
            if not errors[-1].retried or attempt == plan.retries + 1:
                break
            delay_s = plan.retry_delay_ms / 1000
            # No retry starts that the deadline would cut before it could run at all.
            if clock.monotonic() + delay_s + MIN_ATTEMPT_MS / 1000 >= deadline_at:
                break
            await clock.sleep(delay_s)
        return Execution(None, final_error(errors), len(errors), progress.degraded)

    async def _parse(self, tool: Tool, stdout: bytes, output_format: Literal["json", "raw"]) -> Any:
        """The result of a clean exit. Up to ``max_output_bytes`` of JSON and an
        ``output_schema`` (whose combinators a tool's output could make slow) are parsed off
        the event loop; a short output with no schema or a linear one is parsed on it,
        sparing the call the two thread hops (their cost: docs/performance.md, "Figures
        behind the code").

        Raises:
            CallError: as ``parse_result``.
        """
        if len(stdout) <= INLINE_PARSE_BYTES and tool.output_linear:
            return parse_result(tool, stdout, output_format)
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, parse_result, tool, stdout, output_format
        )

    def _cancelled_event(
        self, tool: Tool, ctx: CallContext, attempt: int, sandbox: Sandbox, started: float
    ) -> None:
        self._emit_attempt(tool, ctx, attempt, sandbox, started, cancelled=True)

    def _attempt_event(
        self,
        tool: Tool,
        ctx: CallContext,
        attempt: int,
        sandbox: Sandbox,
        outcome: SandboxOutcome,
        started: float,
        error: CallError | None,
        pooled: bool,
        events: ToolEvents,
    ) -> None:
        ignored = {"eventsIgnored": events.ignored_count} if events.ignored_count else {}
        self._emit_attempt(
            tool,
            ctx,
            attempt,
            sandbox,
            started,
            exitCode=outcome.exit_code,
            signal=outcome.signal,
            # The error's own reason when it has one: a tool_error is an exit_code outcome.
            reason=(error.reason if error else None) or (outcome.reason.value if outcome.reason else None),
            code=error.code.value if error else None,
            degraded=outcome.degraded,
            warm=outcome.warm,
            **({"forked": True} if outcome.forked else {}),
            **({"pooled": True} if pooled else {}),
            missing=list(outcome.missing),
            **({"node": outcome.node} if outcome.node is not None else {}),
            stderr=outcome.stderr_tail[-500:],
            **ignored,
        )

    def _emit_attempt(
        self, tool: Tool, ctx: CallContext, attempt: int, sandbox: Sandbox, started: float, **fields: Any
    ) -> None:
        """One ``call.attempt`` event: the fields every attempt has, then ``fields``."""
        ctx.telemetry.attempt_ended(fields)
        self._audit.emit(
            "call.attempt",
            ctx.scrubber,
            toolName=tool.name,
            **ctx.audit_fields(),
            attempt=attempt,
            sandbox=sandbox.name,
            duration=round((self._clock.monotonic() - started) * 1000),
            **fields,
        )


def _payload(params: dict[str, Any], spec: LaunchSpec, attempt: int) -> bytes:
    document = {
        "params": params,
        "context": {"requestId": spec.request_id, "toolName": spec.tool_name, "attempt": attempt},
    }
    return json.dumps(document, ensure_ascii=False, allow_nan=False).encode("utf-8")


async def run_attempt(
    sandbox: Sandbox,
    spec: LaunchSpec,
    limits: Limits,
    work: bytes | Dialogue,
    events: EventSink | None = None,
) -> SandboxOutcome:
    """One attempt in a fresh sandbox, closed on every path; the tool's events to
    ``events`` when its sandbox streams them.

    A cancellation leaves no sandbox behind (trio's ``run_process`` is the model): a
    ``prepare`` once started runs to its end and what it made is closed, and ``close``
    runs to its end however often the call is cancelled meanwhile; then the cancellation
    goes on. The tool itself is killed at once: ``run`` is cancelled where it waits.
    """
    preparing = asyncio.ensure_future(sandbox.prepare(spec, limits))
    try:
        prepared = await finish_shielded(preparing)
    except SandboxUnavailable as exc:
        return _unavailable(exc)
    except asyncio.CancelledError as cancel:
        if preparing.done() and not preparing.cancelled() and preparing.exception() is None:
            await _close(preparing.result(), cancel)
        raise
    try:
        if isinstance(work, bytes):
            if events is not None and isinstance(prepared, StreamsEvents):
                prepared.stream_events(events)
            outcome = await prepared.run(work)
        elif isinstance(prepared, Converses):
            outcome = await prepared.converse(work)
        else:
            raise SandboxUnavailable(f"the {sandbox.name} backend cannot host MCP servers")
    except SandboxUnavailable as exc:
        outcome = _unavailable(exc)
    except BaseException as exc:  # cancelled, or a fault: torn down first either way
        await _close(prepared, exc if isinstance(exc, asyncio.CancelledError) else None)
        raise
    try:
        await _close(prepared, None)
    except WorkspaceNotApplied as exc:  # whatever the tool's own ending: its writes are half there
        return replace(outcome, reason=StopReason.WORKSPACE_NOT_APPLIED, message=exc.message)
    return outcome


async def _close(prepared: PreparedSandbox, cancel: asyncio.CancelledError | None) -> None:
    """Close ``prepared`` to its end, shielded. While a cancellation is on its way up it
    stays what is raised; an error of ``close`` is then its cause."""
    if cancel is None:
        await finish_shielded(prepared.close())
        return
    try:
        await finish_shielded(prepared.close())
    except Exception as failure:
        raise cancel from failure


def _unavailable(exc: SandboxUnavailable) -> SandboxOutcome:
    return SandboxOutcome.never_ran(StopReason.SANDBOX_UNAVAILABLE, exc.message)
