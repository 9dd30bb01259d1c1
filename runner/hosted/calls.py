"""One call of a hosted MCP server's tool: the dialogue the executor hands the sandbox,
and what its outcome becomes (``answers``)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from mcp.shared.dispatcher import ProgressFnT

from runner.errors import CallError
from runner.hosted.answers import protocol_error, settle
from runner.hosted.session import CallTool
from runner.redaction import Scrubber
from sandboxes import SandboxOutcome

# Where the server's ``notifications/progress`` of the call being served go: set by
# ``runner serve`` around a call whose client asked for progress; none by default.
CALL_PROGRESS: ContextVar[ProgressFnT | None] = ContextVar("runner_call_progress", default=None)


class HostedCall(CallTool):
    """``initialize`` and one ``tools/call`` of ``name``, in one fresh sandbox (a warm pool's
    may have said ``initialize`` ahead: ``adopt``)."""

    def __init__(self, name: str, arguments: dict[str, Any], secrets: Scrubber) -> None:
        relay = CALL_PROGRESS.get()

        async def scrubbed(progress: float, total: float | None, message: str | None) -> None:
            assert relay is not None
            # The tool's secrets never reach the client, in progress messages either.
            await relay(progress, total, secrets.scrub_text(message) if message else message)

        super().__init__(name, arguments, scrubbed if relay is not None else None)

    def settled(self, outcome: SandboxOutcome) -> SandboxOutcome:
        return settle(outcome, self.spoken)

    def protocol_error(self, tool_name: str, secrets: Scrubber) -> CallError | None:
        return protocol_error(tool_name, self.spoken, secrets)
