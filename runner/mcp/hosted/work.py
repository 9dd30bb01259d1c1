"""The hosted side's work for the call path (``runner.call.hosting.HostedWork``): the MCP
SDK is imported only when a hosted server's tool is called or primed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.call.hosting import HeldDialogue, HeldOpening, HostedDialogue

if TYPE_CHECKING:
    from runner.schema.redaction import Scrubber
    from sandboxes.events import EventSink


class McpWork:
    def dialogue(
        self, tool_name: str, params: dict[str, Any], secrets: Scrubber, events: EventSink | None = None
    ) -> HostedDialogue:
        from runner.mcp.hosted.dialogue import HostedCall

        return HostedCall(tool_name, params, secrets, events)

    def opening(self) -> HeldOpening:
        from runner.mcp.hosted.session import Handshake

        return Handshake()

    def held(self) -> HeldDialogue:
        from runner.mcp.hosted.held import HeldServer

        return HeldServer()


MCP_WORK = McpWork()
