"""Warm pools of the docker backend against a real daemon: single use, a fresh
container per call, close and SIGKILL of the holder leave no container, and a warm call
that times out kills its own container only.

The containers of a runner are found by their owner label (the runner's pid); a warm
container exists before its call, so it has no request id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import TRACING_TOOL, ToolBench, wait_for
from docker import APIClient

from runner import Runner
from sandboxes.docker._client import LABEL_OWNER

pytestmark = pytest.mark.docker

# Starting containers is slower than spawning processes: the pool gets longer to fill.
CONTAINERS_READY_S = 20.0


def _containers(client: APIClient, owner: int, running_only: bool = False) -> set[str]:
    found = client.containers(all=not running_only, filters={"label": f"{LABEL_OWNER}={owner}"})
    return {str(container["Id"]) for container in found}


def _idle(runner: Runner) -> int:
    return runner.warm_sandboxes().get("trace", 0)


def _attempts(bench: ToolBench) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [event for event in events if event["event"] == "call.attempt"]


@pytest.fixture
def pooled(bench: ToolBench, docker_client: APIClient) -> ToolBench:
    bench.tool("trace", TRACING_TOOL, sandbox="docker", image="runner/base:latest")
    bench.policy["tools"] = {"trace": {"pool": 2}}
    bench.policy["pool"] = {"max_idle_ms": 600000}
    return bench


def test_twenty_pooled_calls_each_get_a_fresh_container_and_see_none_of_the_others(
    pooled: ToolBench, docker_client: APIClient
) -> None:
    hosts: list[str] = []
    with pooled.runner() as runner:
        for n in range(20):
            wait_for(lambda: _idle(runner) == 2, CONTAINERS_READY_S)
            answer = runner.handle({"toolName": "trace", "params": {"n": n}})
            assert answer["success"], answer
            seen = answer["result"]
            assert seen["tmp_before"] == [], f"call {n} saw {seen['tmp_before']}"
            # Docker's init is 1, then the gate that waits for the tool (its trailer); nothing
            # else but the tool itself, no earlier call's child.
            ours = {1, seen["parent"], seen["me"]}
            assert set(seen["pids"]) <= ours, f"call {n} saw other processes: {seen['pids']}"
            assert "REQUEST_ID" not in seen["env"]
            hosts.append(seen["host"])
    assert len(set(hosts)) == 20  # a container's hostname is its id: one container per call
    assert [event["warm"] for event in _attempts(pooled)] == [True] * 20
    assert _containers(docker_client, os.getpid()) == set()


def test_closing_the_runner_leaves_no_container(pooled: ToolBench, docker_client: APIClient) -> None:
    runner = pooled.runner()
    wait_for(lambda: _idle(runner) == 2, CONTAINERS_READY_S)
    assert len(_containers(docker_client, os.getpid(), running_only=True)) == 2
    runner.close()
    assert _containers(docker_client, os.getpid()) == set()


def test_the_timeout_counts_from_the_payload_not_from_the_start(pooled: ToolBench) -> None:
    with pooled.runner() as runner:
        wait_for(lambda: _idle(runner) == 2, CONTAINERS_READY_S)
        time.sleep(1.0)  # idle far longer than the call's timeout
        answer = runner.handle({"toolName": "trace", "params": {"sleep": 0.1}, "options": {"timeout": 800}})
    assert answer["success"], answer
    assert [event["warm"] for event in _attempts(pooled)] == [True]


def test_a_warm_call_that_times_out_kills_only_its_own_container(
    pooled: ToolBench, docker_client: APIClient
) -> None:
    with pooled.runner() as runner:
        wait_for(lambda: _idle(runner) == 2, CONTAINERS_READY_S)
        before = _containers(docker_client, os.getpid(), running_only=True)
        assert len(before) == 2
        answer = runner.handle({"toolName": "trace", "params": {"sleep": 30}, "options": {"timeout": 500}})
        assert answer["error"]["code"] == "TIMEOUT", answer
        survivors = before & _containers(docker_client, os.getpid(), running_only=True)
        assert len(survivors) == 1  # the other warm container, untouched and still running
        wait_for(lambda: _idle(runner) == 2, CONTAINERS_READY_S)
        (survivor,) = survivors
        assert survivor in _containers(docker_client, os.getpid(), running_only=True)
        assert runner.handle({"toolName": "trace"})["success"]
    assert [event["warm"] for event in _attempts(pooled)] == [True, True]


KEEPER = """
import sys, time
from runner import Runner
runner = Runner.load(tools=sys.argv[1], policies=sys.argv[2], audit_log=sys.argv[3])
deadline = time.monotonic() + 30
while runner.warm_sandboxes().get("trace") != 3 and time.monotonic() < deadline:
    time.sleep(0.02)
print("ready" if runner.warm_sandboxes().get("trace") == 3 else "not pooled", flush=True)
time.sleep(120)
"""


def test_sigkill_of_a_runner_holding_a_pool_leaves_no_container(
    pooled: ToolBench, docker_client: APIClient
) -> None:
    pooled.policy["tools"] = {"trace": {"pool": 3}}
    pooled.runner().close()  # writes the policy file
    argv = [sys.executable, "-c", KEEPER, str(pooled.tools), str(pooled.root / "policies.yaml"), os.devnull]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "ready\n"
        assert len(_containers(docker_client, holder.pid, running_only=True)) == 3
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    # The holder's watchdog removes every container labelled with its pid.
    wait_for(lambda: _containers(docker_client, holder.pid) == set(), 10.0)
