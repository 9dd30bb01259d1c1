"""The work of a hosted MCP server's tool as the call path sees it, without MCP.

A hosted tool is spoken with rather than fed a payload: each attempt gets a fresh
``HostedDialogue``, and a warm pool may say the server's opening ahead (``HeldOpening``)
so that its call starts past it; a session holds one conversation with a server
(``HeldDialogue``) in which each of its calls' dialogues speaks. The MCP side supplies
them (``runner.mcp.hosted.work``) and the ``Runner`` plugs it in; the core never imports
the MCP SDK or ``runner.mcp``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from runner.errors import CallError
from runner.schema.redaction import Scrubber
from sandboxes import Dialogue, Opening, SandboxOutcome
from sandboxes.events import EventSink


class HostedDialogue(Dialogue, Protocol):
    """One attempt's conversation with a hosted server's tool."""

    def settled(self, outcome: SandboxOutcome) -> SandboxOutcome:
        """The sandbox's outcome with what the server answered as its result."""
        ...

    def protocol_error(self, tool_name: str, secrets: Scrubber) -> CallError | None:
        """The error when the server broke the protocol; None when it kept it."""
        ...


class HeldDialogue(Dialogue, Protocol):
    """A session's one conversation with a hosted server, in which each call speaks."""

    async def serve(self, call: HostedDialogue) -> None:
        """Speak ``call``'s request in the held conversation; return once it is answered.

        Raises:
            Exception: the conversation ended first (``call`` says so if the server
                broke the protocol).
        """
        ...

    def cap_calls(self, max_output_bytes: int) -> None:
        """End the conversation when the server writes more than ``max_output_bytes`` for
        one call (the run's own cap is the whole session's)."""
        ...


class HeldOpening(Opening, Protocol):
    """An opening said ahead; ``result`` what the server answered (None until it did)."""

    @property
    def result(self) -> Any: ...


@runtime_checkable
class Adopts(Protocol):
    """A dialogue that can start past an opening said ahead."""

    def adopt(self, result: Any) -> None: ...


class HostedWork(Protocol):
    """What the call path needs to run a hosted server's tool."""

    def dialogue(
        self, tool_name: str, params: dict[str, Any], secrets: Scrubber, events: EventSink | None = None
    ) -> HostedDialogue:
        """The conversation of one attempt calling ``tool_name`` (the server's own name); the
        server's log messages and content blocks go to ``events``."""
        ...

    def opening(self) -> HeldOpening:
        """A new opening for a warm sandbox of a hosted server."""
        ...

    def held(self) -> HeldDialogue:
        """A new conversation to hold with a hosted server for a whole session."""
        ...


class NoHostedWork:
    """The call path without the MCP side: a hosted tool's call is a fault of the runner."""

    def dialogue(
        self, tool_name: str, params: dict[str, Any], secrets: Scrubber, events: EventSink | None = None
    ) -> HostedDialogue:
        raise RuntimeError(f"no hosted work plugged in: cannot call the MCP tool {tool_name!r}")

    def opening(self) -> HeldOpening:
        raise RuntimeError("no hosted work plugged in: cannot prime a hosted server")

    def held(self) -> HeldDialogue:
        raise RuntimeError("no hosted work plugged in: cannot hold a hosted server")


NO_HOSTED_WORK: HostedWork = NoHostedWork()
