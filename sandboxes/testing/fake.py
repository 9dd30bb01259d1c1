"""A backend that runs nothing: each call is answered by a function of yours.

For testing what sits above a sandbox (an agent, a tool's callers, retry and deadline
handling) without bubblewrap, cgroups or Docker, as ``httpx.MockTransport`` answers
requests without a network::

    from runner import Runner
    from sandboxes.testing import FakeBackend, ToolError

    def answer(call):
        if call.params["b"] == 0:
            raise ToolError("cannot divide by zero", code="DIVIDE_BY_ZERO")
        return call.params["a"] / call.params["b"]

    backend = FakeBackend(answer)
    runner = Runner.load(tools="tools", policies="policies.yaml", sandbox_factory=lambda name: backend)

The handler gets a ``ToolCall`` (the tool's ``params``, the request's ``context``, the
launch spec and limits) and answers as a tool would:

- a value: the tool's result (printed as JSON, exit status 0);
- ``raise ToolError(message, code=..., retryable=..., details=...)``: the error document
  of ``runner_tool.ToolError`` on stdout, exit status 1;
- any other exception: a crash, its one line on stderr, exit status 1 (as
  ``runner_tool.run`` does);
- ``Timeout()``: the tool ran out of time (reported at once, its duration the timeout);
- ``Crash(exit_code=..., signal=..., stderr=...)``: the tool died without an answer;
- a ``SandboxOutcome``: exactly that outcome (a memory limit, a degraded run, ...).

A handler may also be ``async``: it is then awaited under the call's timeout, in real
time, and one that does not answer in time ends as a timeout. A result whose JSON is
longer than the call's ``max_output_bytes`` ends as an output limit, as a tool writing
that much would.

What it does not do: isolate or limit anything. It never runs the tool's command, so it
cannot tell whether the tool starts, stays within its memory, processes and CPU time, or
sees its secrets and workspace as a sandbox would show them: test the tool itself through
a real backend (``runner exec``, or the contract kit for a backend).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandboxes.base import LaunchSpec, Limits, SandboxOutcome, SandboxUnavailable, StopReason
from sandboxes.view import STDERR_TAIL_BYTES

__all__ = ["Crash", "FakeBackend", "FakePrepared", "Handler", "Timeout", "ToolCall", "ToolError"]


class ToolError(Exception):
    """A failure the tool reports on purpose, as ``runner_tool.ToolError`` in a real tool."""

    def __init__(
        self,
        message: str,
        code: str | None = None,
        retryable: bool = False,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.retryable = retryable
        self.details = dict(details) if details is not None else None

    def document(self) -> dict[str, Any]:
        """The error document a tool prints (``code`` and ``details`` only when given)."""
        error: dict[str, Any] = {"message": self.message}
        if self.code is not None:
            error["code"] = self.code
        error["retryable"] = self.retryable
        if self.details is not None:
            error["details"] = self.details
        return {"error": error}


@dataclass(frozen=True)
class Timeout:
    """The answer of a tool that runs out of time: the call ends as a timeout at once."""


@dataclass(frozen=True)
class Crash:
    """The answer of a tool that dies without answering: an exit status, or a signal."""

    exit_code: int | None = 1
    signal: int | None = None
    stderr: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One call as the fake backend's handler sees it."""

    spec: LaunchSpec
    limits: Limits
    payload: bytes
    # The payload read as the runner's request: {"params": ..., "context": ...}. A
    # payload that is not such a request leaves them empty (``payload`` has it all).
    params: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_name(self) -> str:
        return self.spec.tool_name

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def secrets(self) -> Mapping[str, str]:
        """The secrets a real backend would hand the tool as environment variables."""
        return self.spec.secrets


Handler = Callable[[ToolCall], object | Awaitable[object]]


class FakeBackend:
    """A ``Sandbox`` whose every run is answered by ``handler`` (see the module's text).

    ``unavailable``: a reason to refuse every ``prepare`` with ``SandboxUnavailable``, as a
    backend does on a machine that cannot isolate. ``calls`` lists every call answered,
    oldest first; ``alive`` tells whether a call of a request id is being answered now.
    """

    def __init__(self, handler: Handler, *, name: str = "fake", unavailable: str | None = None) -> None:
        self.name = name
        self._handler = handler
        self._unavailable = unavailable
        self.calls: list[ToolCall] = []
        self._running: dict[str, int] = {}

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> FakePrepared:
        """A prepared fake sandbox for one run.

        Raises:
            SandboxUnavailable: the backend was made ``unavailable``.
        """
        if self._unavailable is not None:
            raise SandboxUnavailable(self._unavailable)
        return FakePrepared(self, spec, limits)

    def alive(self, request_id: str) -> bool:
        """Whether a run of ``request_id`` is being answered now (``Harness.alive``)."""
        return self._running.get(request_id, 0) > 0

    async def answer(self, call: ToolCall) -> SandboxOutcome:
        """The outcome of ``call``: ``handler``'s answer, as a sandbox would report it."""
        self.calls.append(call)
        request_id = call.request_id
        self._running[request_id] = self._running.get(request_id, 0) + 1
        started = time.monotonic()
        try:
            return await _outcome_of(self._handler, call, started)
        finally:
            self._running[request_id] -= 1


class FakePrepared:
    """One run of a ``FakeBackend``; ``close`` is safe to call twice, and without a run."""

    def __init__(self, owner: FakeBackend, spec: LaunchSpec, limits: Limits) -> None:
        self._owner = owner
        self._spec = spec
        self._limits = limits
        self._ran = False
        self.closed = False

    async def run(self, payload: bytes) -> SandboxOutcome:
        """Answer ``payload`` through the backend's handler.

        Raises:
            SandboxUnavailable: the sandbox was closed, or served its run already.
        """
        if self._ran or self.closed:
            raise SandboxUnavailable("a prepared sandbox serves one run")
        self._ran = True
        params, context = _request_of(payload)
        call = ToolCall(self._spec, self._limits, payload, params, context)
        return await self._owner.answer(call)

    async def close(self) -> None:
        self.closed = True


def _request_of(payload: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        request = json.loads(payload)
    except ValueError:
        return {}, {}
    if not isinstance(request, dict):
        return {}, {}
    params, context = request.get("params", {}), request.get("context", {})
    return params if isinstance(params, dict) else {}, context if isinstance(context, dict) else {}


async def _outcome_of(handler: Handler, call: ToolCall, started: float) -> SandboxOutcome:
    timeout_s = call.limits.timeout_ms / 1000
    try:
        answer = handler(call)
        if inspect.isawaitable(answer):
            async with asyncio.timeout(timeout_s):
                answer = await answer
    except ToolError as exc:
        return _finished(call, started, 1, json.dumps(exc.document()).encode(), "")
    except TimeoutError:
        answer = Timeout()
    except Exception as exc:  # a bug of the tool: one line on stderr, as runner_tool.run says it
        return _finished(call, started, 1, b"", f"{type(exc).__name__}: {exc}\n")
    if isinstance(answer, SandboxOutcome):
        return answer
    if isinstance(answer, Timeout):
        return SandboxOutcome(None, None, b"", "", float(call.limits.timeout_ms), reason=StopReason.TIMEOUT)
    if isinstance(answer, Crash):
        reason = StopReason.SIGNAL if answer.signal is not None else StopReason.EXIT_CODE
        return _finished(call, started, answer.exit_code, b"", answer.stderr, answer.signal, reason)
    try:
        stdout = json.dumps(answer, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        return _finished(call, started, 1, b"", f"the result is not JSON: {exc}\n")
    return _finished(call, started, 0, stdout, "")


def _finished(
    call: ToolCall,
    started: float,
    exit_code: int | None,
    stdout: bytes,
    stderr: str,
    signal: int | None = None,
    reason: StopReason | None = None,
) -> SandboxOutcome:
    if reason is None and exit_code != 0:
        reason = StopReason.EXIT_CODE
    if len(stdout) > call.limits.max_output_bytes:
        exit_code, signal, stdout, reason = None, None, b"", StopReason.OUTPUT_LIMIT
    return SandboxOutcome(
        exit_code=exit_code,
        signal=signal,
        stdout=stdout,
        stderr_tail=stderr[-STDERR_TAIL_BYTES:],
        duration_ms=(time.monotonic() - started) * 1000,
        reason=reason,
    )
