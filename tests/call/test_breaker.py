"""The breaker through the public API: one probe, handed back on a fault or a cancel,
a positive ``retryAfterMs`` always, only the tool's own failures counted; and teardown
that a cancellation cannot cut short. A scripted in-memory backend: these are rules of
the runner, not of a process boundary (``test_lifecycle.py`` has the real sandboxes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import ToolBench
from support.fakes import ManualClock, failed, ok

from runner import Runner
from sandboxes import LaunchSpec, Limits, SandboxOutcome, StopReason

Behaviour = Callable[["ScriptedPrepared"], Awaitable[SandboxOutcome]]


@dataclass
class ScriptedSandbox:
    """Each ``prepare`` takes the next behaviour off ``script`` (a fault if it is an
    exception); the prepared sandbox's ``run`` is that behaviour."""

    script: list[Behaviour | BaseException]
    name: str = "scripted"
    prepared: list[ScriptedPrepared] = field(default_factory=list)
    prepare_delay_s: float = 0.0

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> ScriptedPrepared:
        step = self.script.pop(0)
        if self.prepare_delay_s:
            await asyncio.sleep(self.prepare_delay_s)
        if isinstance(step, BaseException):
            raise step
        prepared = ScriptedPrepared(step)
        self.prepared.append(prepared)
        return prepared


@dataclass
class ScriptedPrepared:
    behaviour: Behaviour
    running: asyncio.Event = field(default_factory=asyncio.Event)
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    close_s: float = 0.0
    ran: bool = False
    closed: bool = False

    async def run(self, payload: bytes) -> SandboxOutcome:
        self.ran = True
        self.running.set()
        return await self.behaviour(self)

    async def close(self) -> None:
        self.closing.set()
        await asyncio.sleep(self.close_s)
        self.closed = True


def answers(outcome: SandboxOutcome) -> Behaviour:
    async def behaviour(_: ScriptedPrepared) -> SandboxOutcome:
        return outcome

    return behaviour


async def forever(prepared: ScriptedPrepared) -> SandboxOutcome:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def until(gate: asyncio.Event, outcome: SandboxOutcome) -> Behaviour:
    async def behaviour(_: ScriptedPrepared) -> SandboxOutcome:
        await gate.wait()
        return outcome

    return behaviour


def unavailable() -> SandboxOutcome:
    return SandboxOutcome(None, None, b"", "", 0.0, reason=StopReason.SANDBOX_UNAVAILABLE, message="no")


def scripted_runner(
    bench: ToolBench, script: list[Behaviour | BaseException], threshold: int = 1
) -> tuple[Runner, ScriptedSandbox, ManualClock]:
    bench.policy["circuit_breaker"] = {"failure_threshold": threshold, "reset_timeout_ms": 1000}
    bench.tool("t", "")
    clock = ManualClock()
    sandbox = ScriptedSandbox(script)
    return bench.runner(clock=clock, sandbox_factory=lambda name: sandbox), sandbox, clock


def code(result: Any) -> str | None:
    return None if result.error is None else result.error.code


async def opened(runner: Runner, clock: ManualClock) -> None:
    """One counted failure opens the breaker (threshold 1); then its reset time passes."""
    assert code(await runner.acall("t")) == "EXECUTION_ERROR"
    assert code(await runner.acall("t")) == "CIRCUIT_OPEN"
    clock.now += 1.0


def test_a_fault_in_prepare_during_the_half_open_probe_hands_the_probe_back(bench: ToolBench) -> None:
    runner, _, clock = scripted_runner(
        bench, [answers(failed()), RuntimeError("backend bug"), answers(ok(b'{"v": 1}'))]
    )

    async def scenario() -> None:
        await opened(runner, clock)
        probe = await runner.acall("t")
        assert code(probe) == "EXECUTION_ERROR"
        assert probe.error is not None and probe.error.details["reason"] == "internal"
        after = await runner.acall("t")  # gets its probe: not CIRCUIT_OPEN for ever
        assert after.success is True
        assert after.result == {"v": 1}

    asyncio.run(scenario())


def test_a_cancelled_half_open_probe_hands_the_probe_back(bench: ToolBench) -> None:
    runner, sandbox, clock = scripted_runner(bench, [answers(failed()), forever, answers(ok())])

    async def scenario() -> None:
        await opened(runner, clock)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.acall("t"), 0.2)
        assert sandbox.prepared[-1].closed is True
        assert (await runner.acall("t")).success is True

    asyncio.run(scenario())


def test_while_the_probe_is_out_others_get_circuit_open_with_a_positive_retry_after(
    bench: ToolBench,
) -> None:
    gate = asyncio.Event()
    runner, sandbox, clock = scripted_runner(bench, [answers(failed()), until(gate, ok()), answers(ok())])

    async def scenario() -> None:
        await opened(runner, clock)
        probe = asyncio.ensure_future(runner.acall("t", deadline=3000))
        while len(sandbox.prepared) < 2:
            await asyncio.sleep(0.01)
        await sandbox.prepared[-1].running.wait()
        refused = await runner.acall("t")
        assert code(refused) == "CIRCUIT_OPEN"
        assert refused.error is not None
        assert refused.error.retryable is True
        assert refused.error.details["state"] == "half_open"
        assert 1 <= refused.error.details["retryAfterMs"] <= 3000
        assert refused.metadata.attempts == 0
        gate.set()
        assert (await probe).success is True
        assert (await runner.acall("t")).success is True  # closed again

    asyncio.run(scenario())


def test_an_open_breaker_never_says_retry_after_zero(bench: ToolBench) -> None:
    runner, _, clock = scripted_runner(bench, [answers(failed())])

    async def scenario() -> None:
        assert code(await runner.acall("t")) == "EXECUTION_ERROR"
        clock.now += 0.9999  # 0.1 ms of the 1000 ms left
        refused = await runner.acall("t")
        assert code(refused) == "CIRCUIT_OPEN"
        assert refused.error is not None
        assert refused.error.details["retryAfterMs"] == 1
        assert refused.error.details["state"] == "open"

    asyncio.run(scenario())


def test_a_cancelled_call_is_not_counted_by_the_breaker(bench: ToolBench) -> None:
    runner, _, _ = scripted_runner(bench, [forever, answers(ok())], threshold=1)

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.acall("t"), 0.2)
        assert (await runner.acall("t")).success is True

    asyncio.run(scenario())


def test_unavailable_sandboxes_do_not_open_the_breaker(bench: ToolBench) -> None:
    runner, _, _ = scripted_runner(bench, [answers(unavailable()), answers(unavailable()), answers(failed())])

    async def scenario() -> None:
        for _ in range(2):
            result = await runner.acall("t")
            assert code(result) == "EXECUTION_ERROR"
            assert result.error is not None and result.error.details["reason"] == "sandbox_unavailable"
        assert code(await runner.acall("t")) == "EXECUTION_ERROR"  # the first counted failure
        assert code(await runner.acall("t")) == "CIRCUIT_OPEN"

    asyncio.run(scenario())


def test_a_second_cancel_cannot_cut_the_teardown_short(bench: ToolBench) -> None:
    runner, sandbox, _ = scripted_runner(bench, [forever])

    async def scenario() -> None:
        call = asyncio.ensure_future(runner.acall("t"))
        while not sandbox.prepared:
            await asyncio.sleep(0.01)
        prepared = sandbox.prepared[0]
        prepared.close_s = 0.3
        await prepared.running.wait()
        call.cancel()
        await prepared.closing.wait()
        call.cancel()  # while the sandbox is being closed
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert prepared.closed is True

    asyncio.run(scenario())


def test_a_call_cancelled_while_its_sandbox_is_prepared_closes_what_prepare_made(
    bench: ToolBench,
) -> None:
    runner, sandbox, _ = scripted_runner(bench, [answers(ok())])
    sandbox.prepare_delay_s = 0.3

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.acall("t"), 0.1)
        [prepared] = sandbox.prepared
        assert prepared.ran is False
        assert prepared.closed is True

    asyncio.run(scenario())
