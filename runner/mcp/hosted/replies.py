"""What a hosted MCP server said, as the outcome a tool of ours would have given.

A success becomes the JSON on a clean exit's stdout: ``structuredContent`` when the
server gave it, else its text content; ``isError: true`` (or a JSON-RPC error answering
the call) becomes the error document of a failing tool, so that it is a ``tool_error``
with the server's text as the message. From there on the executor reads it as any
outcome: secrets scrubbed, JSON checked strictly, ``output_schema`` applied. A server
that broke the protocol is a ``PARSE_ERROR``; one that died is the sandbox's outcome as
it stands (``EXECUTION_ERROR``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from runner.errors import CallError, ErrorCode
from runner.mcp.hosted.session import Spoken
from runner.schema.redaction import Scrubber
from runner.tools.tool_errors import one_line
from sandboxes import SandboxOutcome, StopReason

NO_TEXT = "the MCP server reported an error without a message"
# How much of what broke the protocol its error shows.
PREVIEW_CHARS = 120


def settle(outcome: SandboxOutcome, spoken: Spoken) -> SandboxOutcome:
    """``outcome`` of a dialogue that ran to its end, with what the server answered."""
    if not outcome.ok:
        return outcome
    result = spoken.result
    if result is not None and not result.is_error:
        value = result.structured_content if result.structured_content is not None else _text(result.content)
        try:
            return dataclasses.replace(outcome, exit_code=0, stdout=_json(value))
        except ValueError:  # NaN or Infinity: the SDK reads them, JSON has none
            spoken.break_("its result holds a number JSON cannot carry (NaN or Infinity)")
            return outcome
    message = spoken.refused if result is None else _text(result.content)
    if message is None:
        return outcome  # broken: ``protocol_error`` says so
    # Whole, not cut: the executor scrubs the tool's secrets out of it before anything
    # cuts it to a message's length (a secret cut in half would pass the scrub).
    report = {"error": {"message": message if message.strip() else NO_TEXT}}
    return dataclasses.replace(outcome, reason=StopReason.EXIT_CODE, stdout=_json(report))


def protocol_error(tool_name: str, spoken: Spoken, secrets: Scrubber) -> CallError | None:
    """The ``PARSE_ERROR`` of a server that broke the protocol, if it did."""
    if spoken.broken is None:
        return None
    # Scrubbed whole, then cut: a secret cut in half first would pass the scrub.
    evidence = one_line(secrets.scrub_text(spoken.evidence), PREVIEW_CHARS) if spoken.evidence else ""
    shown = f": {evidence!r}" if evidence else ""
    return CallError(
        ErrorCode.PARSE_ERROR,
        f"{tool_name}: the MCP server broke the protocol: {spoken.broken}{shown}",
        {"reason": "protocol"},
    )


def _text(content: list[Any]) -> str:
    return "\n".join(item.text for item in content if getattr(item, "type", None) == "text")


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
