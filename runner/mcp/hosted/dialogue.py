"""One call of a hosted MCP server's tool: the dialogue the executor hands the sandbox,
and what its outcome becomes (``answers``)."""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

from mcp.shared.dispatcher import ProgressFnT

from runner.errors import CallError
from runner.mcp.hosted.replies import protocol_error, settle
from runner.mcp.hosted.session import CallTool
from runner.schema.redaction import Scrubber
from sandboxes import SandboxOutcome

# Where the server's ``notifications/progress`` of the call being served go: set by
# ``runner serve`` around a call whose client asked for progress; none by default.
CALL_PROGRESS: ContextVar[ProgressFnT | None] = ContextVar("runner_call_progress", default=None)
# Progress notifications passed on per call; a server's beyond them are dropped.
MAX_PROGRESS = 100


class HostedCall(CallTool):
    """``initialize`` and one ``tools/call`` of ``name``, in one fresh sandbox (a warm pool's
    may have said ``initialize`` ahead: ``adopt``)."""

    def __init__(self, name: str, arguments: dict[str, Any], secrets: Scrubber) -> None:
        relay = CALL_PROGRESS.get()
        passed = 0

        async def scrubbed(progress: float, total: float | None, message: str | None) -> None:
            nonlocal passed
            assert relay is not None
            # A server may send without end: the client gets a bounded number, each a
            # number JSON can carry.
            if passed >= MAX_PROGRESS or not _finite(progress, total):
                return
            passed += 1
            # The tool's secrets never reach the client, in progress messages either.
            await relay(progress, total, secrets.scrub_text(message) if message else message)

        super().__init__(name, arguments, scrubbed if relay is not None else None)

    def settled(self, outcome: SandboxOutcome) -> SandboxOutcome:
        return settle(outcome, self.spoken)

    def protocol_error(self, tool_name: str, secrets: Scrubber) -> CallError | None:
        return protocol_error(tool_name, self.spoken, secrets)


def _finite(*numbers: float | None) -> bool:
    return all(number is None or math.isfinite(number) for number in numbers)
