"""Warm sandboxes lost before their call, with real sandboxes of both backends: a
tool that spins before reading its input, or exits, while it waits. Such a sandbox is
discarded, never handed out, audited (``pool.discarded``), and its pool backs off, so that
an idle pool burns a bounded amount of CPU; calls meanwhile run cold and get their answer.

Each test tool misbehaves only when started ahead (no ``REQUEST_ID`` yet) and answers when
called cold, so that a later call shows the pool has recovered.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from conftest import ToolBench, docker_ready, wait_for

from runner import Runner
from sandboxes.testing import processes_with_env

# Spins, never reading its input, while it waits for a call; answers when called cold.
SPINNER = """
import json, os, sys
while "REQUEST_ID" not in os.environ:
    pass
json.load(sys.stdin)
print("{}")
"""
# Exits while it waits for a call; answers when called cold.
QUITTER = """
import json, os, sys
if "REQUEST_ID" not in os.environ:
    sys.exit(3)
json.load(sys.stdin)
print("{}")
"""
WINDOW_S = 20.0


@pytest.fixture(params=["subprocess", "docker"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "subprocess":
        return {}
    why = docker_ready()
    if why is not None:
        pytest.skip(why)
    return {"sandbox": "docker", "image": "runner/base:latest"}


def _discarded(bench: ToolBench) -> list[dict[str, Any]]:
    events = (
        [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
        if bench.audit_log.exists()
        else []
    )
    return [event for event in events if event["event"] == "pool.discarded"]


def _idle(runner: Runner) -> int:
    return runner._pools.counts().get("tool", 0)


class CpuMeter:
    """The CPU time of every process carrying ``mark`` in its environment, read every 50 ms
    (each process's last reading: it may have used up to 50 ms more before it died), and
    the tools among them (a container's init and gate carry it too)."""

    def __init__(self, mark: str) -> None:
        self._mark = mark
        self.seen: dict[int, float] = {}
        self.tools: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            for pid in processes_with_env(f"POOL_MARK={self._mark}"):
                try:
                    process = psutil.Process(pid)
                    times = process.cpu_times()
                    if process.cmdline() == ["python3", "main.py"]:
                        self.tools.add(pid)
                except psutil.Error:
                    continue
                self.seen[pid] = max(self.seen.get(pid, 0.0), times.user + times.system)

    @property
    def total(self) -> float:
        return sum(self.seen.values())


@pytest.fixture
def mark() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    wait_for(lambda: processes_with_env(f"POOL_MARK={value}") == [], 10.0)


def test_an_idle_pool_of_a_tool_spinning_before_its_input_burns_bounded_cpu_is_audited_and_recovers(
    bench: ToolBench, backend: dict[str, Any], mark: str
) -> None:
    # Without the check, a warm sandbox spins until max_idle_ms retires it (or its CPU limit
    # kills it) and is replaced at once, for ever: two cores for a pool of two. With it, each
    # is lost after about half its cpu_seconds (or when retired still busy), and the pool
    # waits 5 s, then 10 s, then 40 s... before its next refill: at most two rounds of two
    # sandboxes in the window, each under 1 CPU second and a check's delay.
    bench.tool("tool", SPINNER, env={"POOL_MARK": mark}, limits={"cpu_seconds": 2}, **backend)
    bench.policy["tools"] = {"tool": {"pool": 2}}
    bench.policy["pool"] = {"max_idle_ms": 3000}
    bench.policy["audit"] = {"operator_log": "operator.log"}
    with bench.runner() as runner, CpuMeter(mark) as meter:
        time.sleep(WINDOW_S)
        burned, sandboxes = meter.total, len(meter.tools)
        assert sandboxes <= 4, f"{sandboxes} warm sandboxes started in {WINDOW_S:g} s ({burned:.1f} CPU s)"
        assert burned <= 6.5, f"an idle pool burned {burned:.1f} CPU seconds in {WINDOW_S:g} s"
        # Recovery: between refills the pool is empty, and a call runs cold.
        wait_for(lambda: _idle(runner) == 0, 20.0)
        answer = runner.handle({"toolName": "tool", "requestId": "after-the-spinners"})
    assert answer["success"], answer
    discarded = _discarded(bench)
    assert len(discarded) >= 2, discarded
    for event in discarded:
        assert event["toolName"] == "tool"
        assert event["reason"] in {"busy", "ended"}, event
        assert event["detail"], event
        assert event["retryAfterMs"] >= 5000
    assert [event["lost"] for event in discarded] == list(range(1, len(discarded) + 1))
    operator = (bench.root / "operator.log").read_text()
    assert operator.count("is discarded before its call") == 1  # once per pool


def test_a_warm_sandbox_whose_tool_exited_is_never_handed_out_and_is_audited(
    bench: ToolBench, backend: dict[str, Any], mark: str
) -> None:
    bench.tool("tool", QUITTER, env={"POOL_MARK": mark}, **backend)
    bench.policy["tools"] = {"tool": {"pool": 1}}
    with bench.runner() as runner:
        wait_for(lambda: len(_discarded(bench)) >= 1, 20.0)
        answers = [runner.handle({"toolName": "tool", "requestId": f"after-{n}"}) for n in range(3)]
    assert [answer["success"] for answer in answers] == [True] * 3, answers
    (first, *_) = _discarded(bench)
    assert first["reason"] == "ended"
    if not backend:  # the subprocess backend reads the launcher's status
        assert first["detail"] == "it exited with status 3"
    attempts = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    assert [event["warm"] for event in attempts if event["event"] == "call.attempt"] == [False] * 3
