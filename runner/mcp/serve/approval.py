"""Approval over MCP: the client that sent a call is asked with ``elicitation/create``.

The question names the tool and its params (sensitive ones as ``***``) and asks for one
boolean, ``approve``. The request rides the call's own channel, which a session of the
2025-11-25 handshake has (stdio, and HTTP with its event stream); a 2026-07-28 session has
none. A client that did not declare the elicitation capability, or a
connection that cannot carry a request to the client, cannot be asked: the call is then
refused as ``approval_unavailable``, never run unasked.
"""

from __future__ import annotations

from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError, NoBackChannelError

from runner.call.approval import ApprovalRequest, ApprovalUnavailable, Approver

APPROVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approve": {"type": "boolean", "title": "Approve", "description": "Run this call now"},
    },
    "required": ["approve"],
}

NO_BACK_CHANNEL = (
    "this MCP connection cannot carry a request to the client"
    " (a 2026-07-28 session has no back channel: connect with the 2025-11-25 handshake)"
)


def client_approver(ctx: ServerRequestContext[Any, Any], by: str) -> Approver:
    """The client of request ``ctx``, asked on that request's own channel; ``by`` names it
    in the ``call.approval`` event (the token's client name, or ``stdio``)."""

    async def ask(request: ApprovalRequest) -> bool:
        session = ctx.session
        capabilities = session.client_capabilities
        elicitation = capabilities.elicitation if capabilities is not None else None
        if elicitation is None:
            raise ApprovalUnavailable("the MCP client did not declare the elicitation capability")
        if elicitation.form is None and elicitation.url is not None:
            raise ApprovalUnavailable("the MCP client takes only URL elicitations, not a yes/no form")
        if not session.can_send_request:
            raise ApprovalUnavailable(NO_BACK_CHANNEL)
        try:
            answer = await session.elicit_form(
                request.message(), APPROVE_SCHEMA, related_request_id=ctx.request_id
            )
        except NoBackChannelError as exc:
            raise ApprovalUnavailable(NO_BACK_CHANNEL) from exc
        except MCPError:  # the client answered with an error: not a yes
            return False
        # A decline, a cancel, or an accept without approve: true are all a no.
        return answer.action == "accept" and (answer.content or {}).get("approve") is True

    return Approver(by, ask)
