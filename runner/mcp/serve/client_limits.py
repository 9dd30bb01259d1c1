"""Clients known to give up on a call sooner than the policy's deadline allows.

MCP has no field for a client's request timeout: ``initialize`` carries only the client's
name and version. So the server can know a timeout only where the client has a fixed one
and names itself; for those, ``runner serve`` warns in the operator log when the largest
deadline of the tools it lists would outlast it (the client would give up first, and the
model would never see the runner's TIMEOUT answer). Every other client's timeout is set
on the client's side (docs/serve.md, "Timeouts that agree").
"""

from __future__ import annotations

# By the name in clientInfo: Claude Desktop ends a call after 60 s (the MCP TypeScript
# SDK's default request timeout), with no setting for it.
FIXED_LIMITS_S = {"claude-ai": 60.0}


def gives_up_first(client_name: str | None, largest_deadline_ms: int) -> float | None:
    """The client's fixed limit in seconds when it is shorter than ``largest_deadline_ms``
    (else None: unknown, or long enough)."""
    limit = FIXED_LIMITS_S.get(client_name or "")
    return limit if limit is not None and limit * 1000 <= largest_deadline_ms else None
