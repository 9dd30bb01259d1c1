"""The values of the metrics' labels and what they are made from, without Prometheus
itself: the call path imports this (``runner exec`` never loads ``prometheus_client``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from runner.errors import ErrorCode
from sandboxes import StopReason

# The label of what a call's answer says on success, and of a call cancelled before it
# answered; every other value of ``code`` is an error code of the wire format.
OK = "OK"
# Label values for what the request named but the registry or the policy does not know.
UNKNOWN = "(unknown)"
NO_ROLE = "(none)"
# The node of an attempt run on this host (a dispatched one names its Ray node).
LOCAL_NODE = "local"
# Attempt reasons: the sandbox's stop reasons, a tool-reported error, and these.
ATTEMPT_OK = "ok"
ATTEMPT_CANCELLED = "cancelled"
ATTEMPT_REASONS = frozenset(
    {reason.value for reason in StopReason}
    | {code.value.lower() for code in ErrorCode}
    | {"tool_error", "audit_unavailable", "secret_unavailable", ATTEMPT_OK, ATTEMPT_CANCELLED}
)
OTHER_REASON = "other"


@dataclass(frozen=True)
class RunnerState:
    """What the state series show at a scrape: breaker open (1) or closed (0) by tool,
    warm sandboxes ready by pooled tool, and the calls of each pooled tool that took a
    warm sandbox and that started cold (hits, misses)."""

    breakers: dict[str, bool] = field(default_factory=dict)
    pools: dict[str, int] = field(default_factory=dict)
    takes: dict[str, tuple[int, int]] = field(default_factory=dict)


def attempt_reason(reason: str | None) -> str:
    """An attempt's reason as a bounded label: a known one, or ``other``."""
    if reason is None:
        return ATTEMPT_OK
    return reason if reason in ATTEMPT_REASONS else OTHER_REASON


def tool_label(name: str | None, known: Callable[[str], bool]) -> str:
    return name if name is not None and known(name) else UNKNOWN


def role_label(role: str | None, known: Callable[[str], bool]) -> str:
    if role is None:
        return NO_ROLE
    return role if known(role) else UNKNOWN
