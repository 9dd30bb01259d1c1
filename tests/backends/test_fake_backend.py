"""``sandboxes.testing.FakeBackend``: the documented example runs, each kind of answer
becomes the outcome a sandbox would report, and the contract kit's checks that are about
the interface (not about a process) hold for it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import checkout

from runner.config.starter import write_starter
from sandboxes import LaunchSpec, Limits, SandboxOutcome, SandboxUnavailable, StopReason
from sandboxes.testing import CONTRACT, Crash, FakeBackend, Harness, Timeout, ToolCall, ToolError
from sandboxes.testing import Check as ContractCheck


def _docs() -> Path:
    root = checkout()
    if root is None:
        pytest.skip("no checkout beside the suite (RUNNER_CHECKOUT unset): docs/ is not in the wheel")
    return root / "docs" / "python-api.md"


def _documented_example() -> str:
    text = _docs().read_text()
    section = text[text.index("## Testing without a sandbox") :]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "the section has no python example"
    return found.group(1)


def test_the_documented_example_runs_against_the_starter_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_starter(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RUNNER_POLICIES", raising=False)
    monkeypatch.delenv("RUNNER_TOOLS", raising=False)
    namespace: dict[str, object] = {}
    exec(compile(_documented_example(), str(_docs()), "exec"), namespace)
    backend = namespace["backend"]
    assert isinstance(backend, FakeBackend)
    assert [call.tool_name for call in backend.calls] == ["add_numbers"] * 4


def _spec(tmp_path: Path, **secrets: str) -> LaunchSpec:
    return LaunchSpec("adder", "req-1", ("python3", "main.py"), tmp_path, secrets=secrets)


def _answer(
    handler: Callable[[ToolCall], object],
    payload: bytes = b"{}",
    timeout_ms: int = 5000,
    max_output_bytes: int = 1024 * 1024,
) -> SandboxOutcome:
    limits = Limits(timeout_ms=timeout_ms, max_output_bytes=max_output_bytes)

    async def run() -> SandboxOutcome:
        prepared = await FakeBackend(handler).prepare(_spec(Path("/nonexistent")), limits)
        try:
            return await prepared.run(payload)
        finally:
            await prepared.close()

    return asyncio.run(run())


def test_a_value_is_the_result_and_the_handler_sees_the_request() -> None:
    seen: list[ToolCall] = []

    def handler(call: ToolCall) -> object:
        seen.append(call)
        return {"sum": call.params["a"] + call.params["b"]}

    request = {"params": {"a": 1, "b": 2}, "context": {"requestId": "req-1", "attempt": 1}}
    outcome = _answer(handler, json.dumps(request).encode())
    assert outcome.ok and outcome.exit_code == 0
    assert json.loads(outcome.stdout) == {"sum": 3}
    assert seen[0].context == {"requestId": "req-1", "attempt": 1}
    assert seen[0].tool_name == "adder"


def test_a_tool_error_is_the_error_document_with_exit_status_1() -> None:
    def handler(call: ToolCall) -> object:
        raise ToolError("no such city", code="NOT_FOUND", details={"city": "x"})

    outcome = _answer(handler)
    assert outcome.reason is StopReason.EXIT_CODE and outcome.exit_code == 1
    assert json.loads(outcome.stdout) == {
        "error": {
            "message": "no such city",
            "code": "NOT_FOUND",
            "retryable": False,
            "details": {"city": "x"},
        }
    }


def test_any_other_exception_is_a_crash_with_one_line_on_stderr() -> None:
    def handler(call: ToolCall) -> object:
        raise KeyError("city")

    outcome = _answer(handler)
    assert outcome.reason is StopReason.EXIT_CODE and outcome.exit_code == 1
    assert outcome.stdout == b"" and outcome.stderr_tail == "KeyError: 'city'\n"


def test_a_crash_by_signal_and_a_timeout_are_reported_as_a_sandbox_would() -> None:
    killed = _answer(lambda call: Crash(exit_code=None, signal=9, stderr="x" * 20_000))
    assert killed.reason is StopReason.SIGNAL and killed.signal == 9
    assert len(killed.stderr_tail) < 20_000  # a tail, as the backends keep
    timed_out = _answer(lambda call: Timeout(), timeout_ms=1234)
    assert timed_out.reason is StopReason.TIMEOUT and timed_out.duration_ms == 1234


def test_an_async_handler_slower_than_the_timeout_is_a_timeout() -> None:
    async def slow(call: ToolCall) -> object:
        await asyncio.sleep(30)
        return 1

    started = time.monotonic()
    outcome = _answer(slow, timeout_ms=200)
    assert outcome.reason is StopReason.TIMEOUT
    assert time.monotonic() - started < 10


def test_a_result_past_the_output_cap_is_an_output_limit() -> None:
    outcome = _answer(lambda call: "y" * 5000, max_output_bytes=1000)
    assert outcome.reason is StopReason.OUTPUT_LIMIT and outcome.stdout == b""


def test_a_result_that_is_not_json_is_a_crash() -> None:
    outcome = _answer(lambda call: {1, 2})
    assert outcome.reason is StopReason.EXIT_CODE and "not JSON" in outcome.stderr_tail


def test_a_prepared_fake_serves_one_run_and_an_unavailable_one_refuses_prepare(tmp_path: Path) -> None:
    async def scenario() -> None:
        prepared = await FakeBackend(lambda call: 1).prepare(_spec(tmp_path), Limits())
        assert (await prepared.run(b"{}")).ok
        with pytest.raises(SandboxUnavailable):
            await prepared.run(b"{}")
        with pytest.raises(SandboxUnavailable) as refused:
            await FakeBackend(lambda call: 1, unavailable="no isolation here").prepare(
                _spec(tmp_path), Limits()
            )
        assert refused.value.message == "no isolation here"

    asyncio.run(scenario())


# -- the contract kit ----------------------------------------------------------------------


async def _forever(call: ToolCall) -> object:
    await asyncio.sleep(3600)
    return None


def _echo_x(call: ToolCall) -> object:
    return {"echo": json.loads(call.payload)["x"]}


def _stdin_and_secret(call: ToolCall) -> object:
    return {"stdin": call.payload.decode(), "secret": call.secrets.get("API_TOKEN")}


# The checks about the interface, each with the answer its tool would give.
KEPT: dict[str, Callable[[ToolCall], object]] = {
    "check_success_returns_stdout": _echo_x,
    "check_secrets_reach_the_tool_as_environment_and_stdin_stays_the_payload": _stdin_and_secret,
    "check_exit_status_is_reported": lambda call: Crash(exit_code=3),
    "check_a_timeout_kills_the_whole_tree": lambda call: Timeout(),
    "check_output_past_the_cap_is_an_output_limit": lambda call: "y" * 200_000,
    "check_close_twice_is_safe": lambda call: {},
    "check_prepare_then_close_without_run_leaves_nothing": lambda call: {},
    "check_an_unavailable_backend_raises_from_prepare": lambda call: {},
    "check_a_cancelled_run_leaves_nothing": _forever,
}
# The checks about a real process, which a backend that runs nothing cannot keep.
NOT_KEPT = {
    "check_a_program_that_cannot_start_is_not_executable": "the tool's command is never started",
    "check_stderr_is_kept_as_a_tail": "no process writes a stderr to keep the tail of",
    "check_memory_past_the_limit_is_a_memory_limit": "no process: nothing is limited",
    "check_forks_past_the_limit_are_a_pids_limit": "no process: nothing is limited",
    "check_cpu_time_past_the_budget_is_a_cpu_limit": "no process: nothing is limited",
    "check_the_tool_side_helper_imports_and_is_read_only": "no tool runs to import it",
}


def test_every_check_of_the_kit_is_either_kept_or_said_why_not() -> None:
    names = {check.__name__ for check in CONTRACT}
    assert names == set(KEPT) | set(NOT_KEPT)
    assert not set(KEPT) & set(NOT_KEPT)


@pytest.mark.parametrize(
    "check", [c for c in CONTRACT if c.__name__ in KEPT], ids=lambda check: check.__name__
)
def test_the_fake_keeps_the_contract_where_it_is_about_the_interface(
    check: ContractCheck, tmp_path: Path
) -> None:
    backend = FakeBackend(KEPT[check.__name__])
    harness = Harness(
        make=lambda: backend,
        workdir=tmp_path,
        unavailable=lambda: FakeBackend(lambda call: {}, unavailable="no isolation here"),
        alive=backend.alive,
    )
    asyncio.run(check(harness))
    assert backend.calls or check.__name__ in {
        "check_prepare_then_close_without_run_leaves_nothing",
        "check_an_unavailable_backend_raises_from_prepare",
    }
