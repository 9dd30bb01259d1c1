"""A person's approval of a call, when the policy's ``approval:`` asks for one.

The guard asks once the policy and the params are checked, before the sandbox starts. Who
is asked depends on where the call came from: whoever serves it (the MCP server: its
client; ``runner exec``: the terminal) sets ``CALL_APPROVER`` for the call, as
``AUDIT_CLIENT`` is set; otherwise the ``approver=`` given to ``Runner.load`` answers.
Only a yes runs the call: a no, a cancel, no answer in ``approval.timeout_ms``, an
approver that fails and no way to ask at all are each a ``PERMISSION_DENIED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import re
import sys
import threading
import unicodedata
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

from runner.audit.log import AuditLog
from runner.call.executor import CallContext
from runner.clock import Clock
from runner.errors import CallError, ErrorCode

Decision = Literal["approved", "declined", "timeout", "unavailable"]
# How much of the params an approval message shows; a person reads no more than this.
MAX_MESSAGE_PARAMS = 2000
# White space, and letters and symbols that draw as nothing (Hangul fillers, the blank
# Braille pattern): a run of them can push a part of the params out of sight.
_BLANK = r"\s\u115f\u1160\u2800\u3164\uffa0"


@functools.cache
def _blank_run() -> re.Pattern[str]:
    """Four or more blanks, each with the combining marks after it (drawn as nothing on a
    blank: they must not break a run). Built on first use (a walk of every code point)."""
    marks: list[str] = []
    start = None
    for point in range(sys.maxunicode + 2):
        is_mark = point <= sys.maxunicode and unicodedata.category(chr(point)) in ("Mn", "Me")
        if is_mark and start is None:
            start = point
        elif not is_mark and start is not None:
            marks.append(f"\\U{start:08x}-\\U{point - 1:08x}")
            start = None
    return re.compile(f"(?:[{_BLANK}][{''.join(marks)}]*){{4,}}")


@dataclass(frozen=True)
class ApprovalRequest:
    """What a person is asked to approve; ``params`` show sensitive values as ``***``."""

    tool_name: str
    role: str | None
    params: dict[str, Any]

    def message(self) -> str:
        """The question, in words, with the params as JSON (cut short past a bound), every
        control or format character escaped: params come from an agent, and an escape
        sequence in them must not rewrite what the person reads."""
        shown = json.dumps(self.params, ensure_ascii=False, sort_keys=True)
        # Runs of white space shown as counted: padding cannot push a part out of sight.
        shown = _blank_run().sub(lambda run: f"<{len(run.group())} spaces>", shown)
        if len(shown) > MAX_MESSAGE_PARAMS:
            # Both ends and the size: what a long value hides at its end is shown too.
            half = MAX_MESSAGE_PARAMS // 2
            left_out = len(shown) - 2 * half
            shown = f"{shown[:half]} ...[{left_out} characters not shown]... {shown[-half:]}"
        who = "a call naming no role" if self.role is None else f"role {self.role!r}"
        question = f"Approve the call of {self.tool_name} by {who} with params {shown}?"
        return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in question)


class ApprovalUnavailable(Exception):
    """There is no way to ask here (a client without elicitation, no terminal)."""


@dataclass(frozen=True)
class Approver:
    """Who answers (``by``, for the audit event) and how they are asked: ``ask`` returns
    True for a yes and False for a no or a cancel.

    ``ask`` raises ``ApprovalUnavailable`` when it cannot ask. ``waited_s``: how long the
    person already took before this call (an answer that comes with a second request)."""

    by: str
    ask: Callable[[ApprovalRequest], Awaitable[bool]]
    waited_s: float = 0.0


# The approver of the call being served, set by whoever serves it (see the module docstring).
CALL_APPROVER: ContextVar[Approver | None] = ContextVar("runner_call_approver", default=None)

# What the Python API's approver is given and gives back.
ApproverFunction = Callable[[str, str | None, dict[str, Any]], "bool | Awaitable[bool]"]


def api_approver(function: ApproverFunction) -> Approver:
    """The ``approver=`` of ``Runner.load``: called with the tool name, the role and the
    params; a plain function runs in a thread of its own, so that it may block (``input``)
    without stopping the runner's other calls or the wait's timeout."""

    async def ask(request: ApprovalRequest) -> bool:
        args = (request.tool_name, request.role, dict(request.params))
        if inspect.iscoroutinefunction(function):
            return await function(*args) is True
        answer = await _in_own_thread(function, args)
        if inspect.isawaitable(answer):
            answer = await answer
        return answer is True  # only a real yes runs the call

    return Approver("api", ask)


async def _in_own_thread(function: ApproverFunction, args: tuple[Any, ...]) -> Any:
    """``function(*args)`` in a daemon thread: one that never answers is left behind at the
    timeout rather than holding the runner's closing (a thread cannot be stopped)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, failure: BaseException | None) -> None:
        if answer.done():
            return
        if failure is not None:
            answer.set_exception(failure)
        else:
            answer.set_result(value)

    def run() -> None:
        try:
            value = function(*args)
        except Exception as exc:
            _call_soon(loop, settle, None, exc)
        else:
            _call_soon(loop, settle, value, None)

    threading.Thread(target=run, name="runner-approver", daemon=True).start()
    return await answer


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed while the approver thought
        loop.call_soon_threadsafe(callback, *args)


class ApprovalGate:
    """Asks for approval where the policy wants it, and writes each answer as ``call.approval``."""

    def __init__(self, audit: AuditLog, clock: Clock, default: Approver | None) -> None:
        self._audit = audit
        self._clock = clock
        self._default = default

    async def wait(self, tool_name: str, ctx: CallContext, params: dict[str, Any], timeout_ms: int) -> float:
        """Ask, and return the seconds the answer took (which the call's deadline does not count).

        Raises:
            CallError: PERMISSION_DENIED, reason ``not_approved`` (a no, a cancel, no answer in
                time, a failing approver) or ``approval_unavailable`` (nobody to ask).
        """
        approver = CALL_APPROVER.get() or self._default
        request = ApprovalRequest(tool_name, ctx.role, params)
        started = self._clock.monotonic()
        decision: Decision
        problem = ""
        if approver is None:
            decision, problem = "unavailable", "nobody is there to ask (no approver)"
        else:
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    decision = "approved" if await approver.ask(request) else "declined"
            except TimeoutError:
                decision = "timeout"
            except ApprovalUnavailable as exc:
                decision, problem = "unavailable", str(exc)
            except Exception as exc:  # an approver's own fault: never a yes
                self._audit.operator.warn(f"the approver of {tool_name} failed: {type(exc).__name__}: {exc}")
                decision = "declined"
        waited = self._clock.monotonic() - started
        self._audit.emit(
            "call.approval",
            ctx.scrubber,
            toolName=tool_name,
            **ctx.audit_fields(),
            decision=decision,
            by=approver.by if approver is not None else None,
            waitedMs=round((waited + (approver.waited_s if approver is not None else 0.0)) * 1000),
        )
        if decision == "approved":
            return waited
        raise _refusal(tool_name, decision, problem, timeout_ms)


def _refusal(tool_name: str, decision: Decision, problem: str, timeout_ms: int) -> CallError:
    if decision == "unavailable":
        message = f"{tool_name} needs a person's approval and cannot ask for it: {problem}"
        return CallError(
            ErrorCode.PERMISSION_DENIED, message, {"reason": "approval_unavailable"}, retryable=False
        )
    why = f"no answer within {timeout_ms} ms" if decision == "timeout" else "the answer was no"
    return CallError(
        ErrorCode.PERMISSION_DENIED,
        f"{tool_name} was not approved: {why}",
        {"reason": "not_approved", "decision": decision},
        retryable=False,
    )
