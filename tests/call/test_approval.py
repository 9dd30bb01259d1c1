"""A person's approval (``approval:`` in the policy) through the Python API's ``approver=``:
real runners, real sandboxes; each answer and its ``call.approval`` audit event."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import yaml
from conftest import ToolBench

from runner import Runner
from runner.call.approval import MAX_MESSAGE_PARAMS, ApprovalRequest
from runner.errors import ConfigError

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
SECRET_PARAMS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "token": {"type": "string", "x-sensitive": True}},
}


@pytest.fixture
def held(bench: ToolBench) -> ToolBench:
    """``wipe`` (tagged destructive) needs approval for role user; ``echo`` never does."""
    bench.tool("wipe", ECHO, tags=["destructive"], parameters=SECRET_PARAMS)
    bench.tool("echo", ECHO)
    bench.policy["roles"] = {"user": {"allow": ["*"]}, "ops": {"allow": ["*"]}}
    bench.policy["approval"] = {"tools": ["tag:destructive"], "roles": ["user"], "timeout_ms": 5000}
    return bench


def events(bench: ToolBench, name: str) -> list[dict[str, Any]]:
    lines = bench.audit_log.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_yes_runs_the_call_and_the_approver_sees_tool_role_and_params_with_secrets_hidden(
    held: ToolBench,
) -> None:
    asked: list[tuple[str, str | None, dict[str, Any]]] = []

    def approve(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        asked.append((tool, role, params))
        return True

    with held.runner(approver=approve) as runner:
        result = runner.call("wipe", {"path": "/data", "token": "hunter2-secret"})
    assert result.success, result.error
    assert result.result == {"path": "/data", "token": "hunter2-secret"}
    assert asked == [("wipe", "user", {"path": "/data", "token": "***"})]
    [approval] = events(held, "call.approval")
    assert approval["decision"] == "approved" and approval["by"] == "api"
    assert approval["toolName"] == "wipe" and approval["role"] == "user"
    assert isinstance(approval["waitedMs"], int)
    assert "hunter2-secret" not in held.audit_log.read_text()


def test_a_no_is_permission_denied_not_approved_and_the_tool_never_starts(held: ToolBench) -> None:
    with held.runner(approver=lambda tool, role, params: False) as runner:
        result = runner.call("wipe", {"path": "/data"})
    assert result.error is not None
    assert result.error.code == "PERMISSION_DENIED"
    assert result.error.details["reason"] == "not_approved"
    assert [e["decision"] for e in events(held, "call.approval")] == ["declined"]
    assert events(held, "call.attempt") == []


def test_only_true_is_a_yes(held: ToolBench) -> None:
    with held.runner(approver=lambda tool, role, params: "yes") as runner:
        result = runner.call("wipe", {"path": "/data"})
    assert result.error is not None and result.error.details["reason"] == "not_approved"


@pytest.mark.parametrize("answer", [True, False])
def test_an_async_approver_is_awaited(held: ToolBench, answer: bool) -> None:
    async def approve(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        await asyncio.sleep(0.05)
        return answer

    async def main() -> Any:
        async with held.runner(approver=approve) as runner:
            return await runner.acall("wipe", {"path": "/x"})

    result = asyncio.run(main())
    assert result.success is answer
    assert [e["decision"] for e in events(held, "call.approval")] == ["approved" if answer else "declined"]


def test_a_function_returning_an_awaitable_is_awaited_too(held: ToolBench) -> None:
    async def later() -> bool:
        return True

    with held.runner(approver=lambda tool, role, params: later()) as runner:
        assert runner.call("wipe", {"path": "/x"}).success


@pytest.mark.parametrize("kind", ["async", "blocking"])
def test_no_answer_within_timeout_ms_is_not_approved_timeout(held: ToolBench, kind: str) -> None:
    held.policy["approval"]["timeout_ms"] = 300

    async def never(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        await asyncio.sleep(3600)
        return True

    def blocks(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        time.sleep(30)  # a person who walked away; its thread is left behind
        return True

    started = time.monotonic()
    with held.runner(approver=never if kind == "async" else blocks) as runner:
        result = runner.call("wipe", {"path": "/x"})
    assert time.monotonic() - started < 10
    assert result.error is not None and result.error.details["reason"] == "not_approved"
    [approval] = events(held, "call.approval")
    assert approval["decision"] == "timeout" and approval["waitedMs"] >= 300


def test_without_an_approver_the_call_is_approval_unavailable(held: ToolBench) -> None:
    with held.runner() as runner:
        result = runner.call("wipe", {"path": "/x"})
        echoed = runner.call("echo", {"path": "/x"})
    assert result.error is not None and result.error.code == "PERMISSION_DENIED"
    assert result.error.details["reason"] == "approval_unavailable"
    [approval] = events(held, "call.approval")
    assert approval["decision"] == "unavailable" and approval["by"] is None
    assert echoed.success  # a tool the approval does not name is not held


def test_a_failing_approver_is_a_no(held: ToolBench) -> None:
    def broken(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        raise RuntimeError("approver bug")

    with held.runner(approver=broken) as runner:
        result = runner.call("wipe", {"path": "/x"})
    assert result.error is not None and result.error.details["reason"] == "not_approved"
    assert [e["decision"] for e in events(held, "call.approval")] == ["declined"]


def test_a_role_left_out_of_approval_roles_is_not_asked(held: ToolBench) -> None:
    asked: list[str] = []

    def approver(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        asked.append(tool)
        return False

    with held.runner(approver=approver) as runner:
        result = runner.call("wipe", {"path": "/x"}, role="ops")
    assert result.success and asked == []
    assert events(held, "call.approval") == []


def test_refused_or_invalid_calls_are_never_asked_about(held: ToolBench) -> None:
    held.policy["roles"]["user"]["deny"] = ["wipe"]
    asked: list[str] = []

    def approver(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        asked.append(tool)
        return True

    with held.runner(approver=approver) as runner:
        denied = runner.call("wipe", {"path": "/x"})
        invalid = runner.call("wipe", {"path": 5}, role="ops")
    assert denied.error is not None and denied.error.details["reason"] == "denied_by_role"
    assert invalid.error is not None and invalid.error.code == "INVALID_PARAMS"
    assert asked == []


def test_the_wait_for_a_person_does_not_count_against_the_deadline(held: ToolBench) -> None:
    held.policy["defaults"]["deadline_ms"] = 1000

    async def slow_person(tool: str, role: str | None, params: dict[str, Any]) -> bool:
        await asyncio.sleep(1.5)  # longer than the whole deadline
        return True

    with held.runner(approver=slow_person) as runner:
        result = runner.call("wipe", {"path": "/x"})
    assert result.success, result.error
    assert events(held, "call.approval")[0]["waitedMs"] >= 1500


@pytest.mark.parametrize(
    ("approval", "problem"),
    [
        ({"tools": []}, "approval.tools"),
        ({"tools": ["wipe"], "roles": ["ghost"]}, "ghost"),
        ({"tools": ["wipe"], "roles": []}, "approval.roles"),
        ({"tools": ["wipe"], "timeout_ms": 0}, "approval.timeout_ms"),
        ({"tools": ["wipe"], "timeout_ms": "60s"}, "approval.timeout_ms"),
        ({"tools": ["wipe"], "skip": True}, "approval.skip"),
        ({"tools": ["tag:"]}, "approval.tools"),
    ],
)
def test_a_bad_approval_section_stops_the_runner_with_a_clear_error(
    held: ToolBench, approval: dict[str, Any], problem: str
) -> None:
    held.policy["approval"] = approval
    with pytest.raises(ConfigError) as raised:
        held.runner()
    assert problem in str(raised.value)


def test_the_policy_file_is_read_with_approval(held: ToolBench) -> None:
    (held.root / "policies.yaml").write_text(yaml.safe_dump(held.policy))
    runner = Runner.load(tools=held.tools, policies=held.root / "policies.yaml", audit_log=held.audit_log)
    with runner:
        wipe, echo = runner.registry.get("wipe"), runner.registry.get("echo")
        assert wipe is not None and echo is not None
        assert runner.policy.approval_for(wipe, "user") is not None
        assert runner.policy.approval_for(wipe, "ops") is None
        assert runner.policy.approval_for(echo, "user") is None


def test_the_question_escapes_control_characters_and_is_cut_short() -> None:
    message = ApprovalRequest("wipe", "user", {"path": "\x1b]0;pwned\x07\u009b2J\u202e"}).message()
    assert not any(c in message for c in "\x1b\x07\u009b\u202e")
    assert "\\u009b" in message and "wipe" in message and "'user'" in message
    long = ApprovalRequest("wipe", "user", {"n": "x" * 10_000 + "; rm -rf /"}).message()
    assert len(long) < MAX_MESSAGE_PARAMS + 200 and "characters not shown" in long
    assert "; rm -rf /" in long  # the end of a long value is shown, not cut away
    padded = ApprovalRequest("run", "user", {"command": "ls" + " " * 5000 + "; curl x | sh"}).message()
    assert "ls<5000 spaces>; curl x | sh" in padded
    for blank in "\u3164\u2800\u115f\u1160\uffa0":  # printable, drawn as nothing
        hidden = ApprovalRequest("run", "user", {"command": "ls" + blank * 300 + "; curl x | sh"}).message()
        assert "ls<300 spaces>; curl x | sh" in hidden, blank
    for marked in (" \u034f", "\u3164\ufe0f", " \u17b5"):  # a combining mark between blanks
        hidden = ApprovalRequest("run", "user", {"command": "ls" + marked * 300 + "; curl x | sh"}).message()
        assert "ls<600 spaces>; curl x | sh" in hidden, marked
