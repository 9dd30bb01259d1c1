"""One call of a hosted MCP server's tool: the dialogue the executor hands the sandbox,
and what its outcome becomes (``answers``)."""

from __future__ import annotations

import json
import math
from contextvars import ContextVar
from typing import Any

import mcp_types as types
from mcp.shared.dispatcher import ProgressFnT

from runner.errors import CallError
from runner.mcp.hosted.replies import protocol_error, settle
from runner.mcp.hosted.session import CallTool
from runner.schema.redaction import Scrubber
from sandboxes import SandboxOutcome
from sandboxes.events import EventSink

# Where the server's ``notifications/progress`` of the call being served go: set by
# ``runner serve`` around a call whose client asked for progress; none by default.
CALL_PROGRESS: ContextVar[ProgressFnT | None] = ContextVar("runner_call_progress", default=None)
# Progress notifications passed on per call; a server's beyond them are dropped.
MAX_PROGRESS = 100


class HostedCall(CallTool):
    """``initialize`` and one ``tools/call`` of ``name``, in one fresh sandbox (a warm pool's
    may have said ``initialize`` ahead: ``adopt``).

    The server's progress and log messages, and the blocks of its result other than text
    (images, audio, resources), go to ``events`` as a tool's own events would: the same checks,
    bounds and scrub (``runner.call.events``). Its text is the result already."""

    def __init__(
        self, name: str, arguments: dict[str, Any], secrets: Scrubber, events: EventSink | None = None
    ) -> None:
        self._events = events
        relay = CALL_PROGRESS.get()
        passed = 0

        async def scrubbed(progress: float, total: float | None, message: str | None) -> None:
            nonlocal passed
            # The call's own progress events (``on_event``), checked as a tool's are.
            given = {"progress": progress, "total": total, "message": message}
            self._event({key: value for key, value in given.items() if value is not None})
            # A server may send without end: the client gets a bounded number, each a
            # number JSON can carry.
            if relay is None or passed >= MAX_PROGRESS or not _finite(progress, total):
                return
            passed += 1
            # The tool's secrets never reach the client, in progress messages either.
            await relay(progress, total, secrets.scrub_text(message) if message else message)

        async def logged(params: types.LoggingMessageNotificationParams) -> None:
            event = {"log": params.level, "data": params.data}
            self._event(event if params.logger is None else {**event, "logger": params.logger})

        wants_progress = relay is not None or events is not None
        super().__init__(name, arguments, scrubbed if wants_progress else None, logged)

    def settled(self, outcome: SandboxOutcome) -> SandboxOutcome:
        result = self.spoken.result
        if outcome.ok and result is not None and not result.is_error:
            for block in result.content:
                if block.type != "text":
                    self._event({"content": block.model_dump(by_alias=True, exclude_none=True, mode="json")})
        return settle(outcome, self.spoken)

    def _event(self, event: dict[str, Any]) -> None:
        if self._events is None:
            return
        try:
            record = json.dumps(event, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except ValueError:  # NaN or Infinity: dropped and counted, as a tool's would be
            self._events.ignored()
            return
        self._events.event(record)

    def protocol_error(self, tool_name: str, secrets: Scrubber) -> CallError | None:
        return protocol_error(tool_name, self.spoken, secrets)


def _finite(*numbers: float | None) -> bool:
    return all(number is None or math.isfinite(number) for number in numbers)
