"""A runner's life with real sandboxes: cancelled calls leave no process or container and
say so in the audit trail, ``call`` works inside a running event loop, and closing leaves
no thread, task or sandbox behind."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from conftest import ToolBench
from docker import APIClient

from sandboxes.testing import processes_with_env

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
# Reads its input, starts a child that sleeps too, and sleeps: only a kill ends it.
SLEEPER_WITH_CHILD = """
import subprocess, sys, time
sys.stdin.read()
subprocess.Popen(["sleep", "60"])
time.sleep(60)
"""
SLOW_OPTIONS: dict[str, Any] = {"timeout": 30000, "deadline": 30000, "retries": 0}


def audit_events(bench: ToolBench, request_id: str) -> list[dict[str, Any]]:
    lines = bench.audit_log.read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return [event for event in events if event.get("requestId") == request_id]


def assert_audited_as_cancelled(bench: ToolBench, request_id: str) -> None:
    events = audit_events(bench, request_id)
    [finished] = [e for e in events if e["event"] == "call.finished"]
    assert finished["cancelled"] is True
    assert finished["success"] is False
    assert finished["attempts"] == 1
    [attempt] = [e for e in events if e["event"] == "call.attempt"]
    assert attempt["cancelled"] is True


async def most_processes_seen(marker: str, seen: list[int]) -> None:
    """Record how many processes carry ``marker`` while the call runs (a test that finds
    nothing alive afterwards proves something only if the tool was alive before)."""
    while True:
        seen.append(len(processes_with_env(marker)))
        await asyncio.sleep(0.02)


def test_a_cancelled_call_kills_its_tool_and_the_tools_child_and_is_audited_as_cancelled(
    bench: ToolBench,
) -> None:
    bench.tool("sleeper", SLEEPER_WITH_CHILD)
    request_id = "req_cancel_subprocess"
    marker = f"REQUEST_ID={request_id}"
    seen: list[int] = []

    async def scenario() -> None:
        async with bench.runner() as runner:
            watcher = asyncio.ensure_future(most_processes_seen(marker, seen))
            try:
                call = runner.acall("sleeper", {}, request_id=request_id, **SLOW_OPTIONS)
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(call, 1.5)
            finally:
                watcher.cancel()
            # wait_for has waited for the cancelled call: its teardown is over already.
            assert processes_with_env(marker) == []

    asyncio.run(scenario())
    assert max(seen) >= 2  # the tool and its child were running when the call was cancelled
    assert_audited_as_cancelled(bench, request_id)


@pytest.mark.docker
def test_a_cancelled_docker_call_removes_its_container_and_is_audited_as_cancelled(
    bench: ToolBench, docker_client: APIClient
) -> None:
    from sandboxes.docker._client import LABEL_REQUEST

    bench.tool("dsleeper", SLEEPER_WITH_CHILD, sandbox="docker", image="runner/base:latest")
    request_id = "req_cancel_docker"
    label = {"label": f"{LABEL_REQUEST}={request_id}"}

    async def scenario() -> None:
        async with bench.runner() as runner:
            call = asyncio.ensure_future(runner.acall("dsleeper", {}, request_id=request_id, **SLOW_OPTIONS))
            running: list[dict[str, Any]] = []
            for _ in range(300):  # the container starts within a few seconds
                running = docker_client.containers(filters={**label, "status": "running"})
                if running or call.done():
                    break
                await asyncio.sleep(0.05)
            assert running, "the container never ran"
            await asyncio.sleep(0.3)  # past the gate: the tool and its child run
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(call, 0.01)
            assert docker_client.containers(all=True, filters=label) == []

    asyncio.run(scenario())
    assert_audited_as_cancelled(bench, request_id)


def test_call_works_from_a_thread_whose_event_loop_is_running(bench: ToolBench) -> None:
    bench.tool("echo", ECHO)
    runner = bench.runner()

    async def notebook_cell() -> tuple[Any, dict[str, Any]]:
        # Synchronous calls made while this thread's loop runs, as a notebook cell does.
        return runner.call("echo", {"x": 1}), runner.handle({"toolName": "echo", "params": {"y": 2}})

    result, answer = asyncio.run(notebook_cell())
    assert result.success is True
    assert result.result == {"x": 1}
    assert answer["result"] == {"y": 2}
    runner.close()


def test_leaving_async_with_leaves_no_thread_no_task_and_no_sandbox(bench: ToolBench) -> None:
    bench.tool("echo", ECHO)
    bench.tool("sleeper", SLEEPER_WITH_CHILD)
    before = set(threading.enumerate())
    ids = [f"req_life_{i}" for i in range(4)]

    async def scenario() -> set[asyncio.Task[Any]]:
        async with bench.runner() as runner:
            results = await asyncio.gather(
                *(runner.acall("echo", {"i": i}, request_id=r) for i, r in enumerate(ids))
            )
            assert [r.result for r in results] == [{"i": i} for i in range(4)]
        # Threads of the runner are joined; this loop's own default executor is asyncio's.
        runner_threads = [t for t in set(threading.enumerate()) - before if t.name.startswith("runner-")]
        assert runner_threads == []
        with pytest.raises(RuntimeError):
            await runner.acall("echo", {})
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(scenario()) == set()
    assert settled_threads(before) == set()
    for request_id in ids:
        assert processes_with_env(f"REQUEST_ID={request_id}") == []


def test_closing_a_runner_cancels_its_calls_in_flight_and_leaves_none_of_their_processes(
    bench: ToolBench,
) -> None:
    bench.tool("sleeper", SLEEPER_WITH_CHILD)
    ids = [f"req_close_{i}" for i in range(3)]
    seen: list[int] = []

    async def scenario() -> None:
        runner = bench.runner()
        calls = [
            asyncio.ensure_future(runner.acall("sleeper", {}, request_id=r, **SLOW_OPTIONS)) for r in ids
        ]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(processes_with_env(f"REQUEST_ID={r}") for r in ids):
            await asyncio.sleep(0.05)
        seen.extend(len(processes_with_env(f"REQUEST_ID={r}")) for r in ids)
        await runner.aclose()
        for call in calls:
            assert call.cancelled()
        for request_id in ids:
            assert processes_with_env(f"REQUEST_ID={request_id}") == []

    asyncio.run(scenario())
    assert min(seen) >= 1
    for request_id in ids:
        assert_audited_as_cancelled(bench, request_id)


def test_a_closed_runner_refuses_calls_and_closing_twice_is_harmless(bench: ToolBench) -> None:
    bench.tool("echo", ECHO)
    with bench.runner() as runner:
        assert runner.call("echo", {"a": 1}).result == {"a": 1}
    runner.close()
    with pytest.raises(RuntimeError):
        runner.call("echo", {})
    with pytest.raises(RuntimeError):
        runner.handle({"toolName": "echo"})


def settled_threads(before: set[threading.Thread], settle_s: float = 1.0) -> set[threading.Thread]:
    """Threads alive now that were not before, given a moment to finish exiting."""
    deadline = time.monotonic() + settle_s
    while (extra := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return extra
