"""Approval over MCP: the client that sent a call is asked with ``elicitation/create``.

The question names the tool and its params (sensitive ones as ``***``) and asks for one
boolean, ``approve``. A session of the 2025-11-25 handshake (stdio, and HTTP with its
event stream) carries the request on the call's own channel, and the call waits for the
answer. A 2026-07-28 session has no such channel: its ``tools/call`` is answered with an
``input_required`` result holding the question (``ask_first``), and the client calls again
with the answer and the sealed ``requestState`` (the SDK's ``RequestStateBoundary`` seals
and checks it, bound to the tool and its arguments), which ``client_approver`` then reads,
once: each question has its own id, and a yes already used (``SpentAnswers``) is a no.
A client that did not declare the elicitation capability cannot be asked: the call is
refused as ``approval_unavailable``, never run unasked.
"""

from __future__ import annotations

import collections
import heapq
import json
import secrets
import time
from typing import Any

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp.shared.exceptions import MCPError, NoBackChannelError

from runner.api import Runner
from runner.call.approval import ApprovalRequest, ApprovalUnavailable, Approver
from runner.call.plan import resolve_plan
from runner.call.requests import CallOptions
from runner.config.approval import MAX_TIMEOUT_MS

# The key of the approval among a call's input requests (2026-07-28).
APPROVAL_INPUT = "dev.runner/approval"

APPROVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approve": {"type": "boolean", "title": "Approve", "description": "Run this call now"},
    },
    "required": ["approve"],
}

NO_BACK_CHANNEL = "this MCP connection cannot carry a request to the client"
# The yeses one client may have used at once (each kept until its question's timeout
# ends): past them, its next yes cannot be told from a replay, and it waits.
MAX_SPENT_PER_CLIENT = 10_000


class SpentAnswers:
    """The ids of the 2026-07-28 questions whose yes was used: one yes runs one call."""

    def __init__(self) -> None:
        self._until: dict[str, tuple[float, str]] = {}  # question: (until, client)
        self._expiring: list[tuple[float, str]] = []
        self._held: collections.Counter[str] = collections.Counter()

    def spend(self, question: str, until: float, client: str) -> bool:
        """Mark ``question``'s yes used (kept until ``until``, its timeout's end); False if
        it was already.

        Raises:
            ApprovalUnavailable: ``client`` holds ``MAX_SPENT_PER_CLIENT`` used yeses.
        """
        now = time.time()
        while self._expiring and self._expiring[0][0] < now:
            gone = self._until.pop(heapq.heappop(self._expiring)[1], None)
            if gone is not None:
                self._held[gone[1]] -= 1
        if question in self._until:
            return False
        if self._held[client] >= MAX_SPENT_PER_CLIENT:
            raise ApprovalUnavailable("too many approvals of this client are still in force; ask again later")
        self._until[question] = (until, client)
        self._held[client] += 1
        heapq.heappush(self._expiring, (until, question))
        return True


def state_boundary(server_name: str) -> RequestStateBoundary:
    """Seals the ``requestState`` of a 2026-07-28 approval under a key of this process; it
    outlives the longest ``approval.timeout_ms``, which then decides."""
    security = RequestStateSecurity.ephemeral(ttl=MAX_TIMEOUT_MS / 1000 + 60)
    return RequestStateBoundary(security, default_audience=server_name)


async def ask_first(
    runner: Runner, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams, role: str | None
) -> types.InputRequiredResult | None:
    """The question, when this call of a 2026-07-28 session waits for approval and carries
    no answer yet; None for every other call (it runs, and is refused there if it must be).

    Asked only of a call the policy allows with valid params, as the guard would.
    """
    if ctx.session.can_send_request or params.request_state is not None or not _can_elicit(ctx):
        return None
    tool, policy = runner.registry.get(params.name), runner.policy
    role = policy.resolve_role(role)
    if tool is None or not policy.decide(tool, role).allowed:
        return None
    approval = policy.approval_for(tool, role)
    if approval is None:
        return None
    from runner.schema.compiled import check_params  # jsonschema: only once a call needs it

    arguments = params.arguments or {}
    budget_s = resolve_plan(tool, policy, CallOptions()).deadline_ms / 1000
    check = await anyio.to_thread.run_sync(
        lambda: check_params(tool.params_validator, arguments, tool.sensitive_params, budget_s)
    )
    if check.problem is not None or check.expired:
        return None
    message = ApprovalRequest(tool.name, role, check.audit_params).message()
    question = types.ElicitRequest(
        params=types.ElicitRequestFormParams(message=message, requested_schema=APPROVE_SCHEMA)
    )
    state = json.dumps(
        {
            "tool": tool.name,
            "asked": time.time(),
            "timeoutMs": approval.timeout_ms,
            "question": secrets.token_hex(16),
        }
    )
    return types.InputRequiredResult(input_requests={APPROVAL_INPUT: question}, request_state=state)


def _can_elicit(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Did the client declare form elicitation (an empty ``elicitation: {}`` means form)?"""
    capabilities = ctx.session.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    return elicitation is not None and (elicitation.form is not None or elicitation.url is None)


def _asked_at(params: types.CallToolRequestParams) -> float | None:
    """When the question this call answers was sent (server time), if it answers one."""
    try:
        asked = json.loads(params.request_state or "")["asked"]
    except (ValueError, KeyError, TypeError):
        return None
    return asked if isinstance(asked, float) else None


def _answered(params: types.CallToolRequestParams, spent: SpentAnswers, client: str) -> bool | None:
    """The answer a 2026-07-28 call carries for its approval: True (a yes), False (a no, a
    cancel, an answer already used, or no answer within the timeout it was asked with),
    None (it carries none).

    Raises:
        TimeoutError: the answer came after ``approval.timeout_ms``.
    """
    if params.request_state is None:
        return None
    try:
        state = json.loads(params.request_state)
        asked, timeout_ms, tool, question = (
            state["asked"],
            state["timeoutMs"],
            state["tool"],
            state["question"],
        )
    except (ValueError, KeyError, TypeError):
        return None
    answer = (params.input_responses or {}).get(APPROVAL_INPUT)
    if tool != params.name or not isinstance(answer, types.ElicitResult):
        return False
    if time.time() - asked > timeout_ms / 1000:
        raise TimeoutError
    yes = answer.action == "accept" and (answer.content or {}).get("approve") is True
    # Only a yes is kept: a no runs nothing, however often it is sent.
    return yes and spent.spend(str(question), asked + timeout_ms / 1000, client)


def client_approver(
    ctx: ServerRequestContext[Any, Any], by: str, params: types.CallToolRequestParams, spent: SpentAnswers
) -> Approver:
    """The client of request ``ctx``: its answer if the call carries one (2026-07-28),
    else asked on that request's own channel; ``by`` names it in the ``call.approval``
    event (the token's client name, or ``stdio``)."""

    async def ask(request: ApprovalRequest) -> bool:
        answered = _answered(params, spent, by)
        if answered is not None:
            return answered
        session = ctx.session
        if not _can_elicit(ctx):
            raise ApprovalUnavailable("the MCP client did not declare the elicitation capability (form mode)")
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

    asked = _asked_at(params)
    return Approver(by, ask, max(0.0, time.time() - asked) if asked is not None else 0.0)
