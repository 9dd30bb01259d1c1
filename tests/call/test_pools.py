"""Warm pools, with real sandboxes: single use, refill, max_idle, max_total, close,
SIGKILL of the runner holding them, and the timeout counted from the payload.

A warm sandbox exists before its call, so its tool has no ``REQUEST_ID``: each test tool
carries a marker of its own in the manifest's ``env`` and is found by it in ``/proc``
(only the tool's own process has it: bubblewrap gets its arguments through a descriptor).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import TRACING_TOOL, ToolBench, call_cgroups, our_cgroups, wait_for

from runner import Runner
from runner.call.policy import Policy
from runner.call.pool_plans import PoolPlan
from runner.call.pools import REFILL_DEFER_S, Ready, WarmPools, _Pool
from sandboxes import LaunchSpec, Limits, PreStarts, WarmSandbox
from sandboxes.subprocess.sandbox import default_state_dir
from sandboxes.testing import processes_with_env


def _marker() -> tuple[str, str]:
    value = uuid.uuid4().hex
    return "POOL_MARK", value


def _warm_pids(mark: str) -> list[int]:
    return processes_with_env(f"POOL_MARK={mark}")


def _idle(runner: Runner) -> dict[str, int]:
    return runner.warm_sandboxes()


def _attempts(bench: ToolBench) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [event for event in events if event["event"] == "call.attempt"]


def _our_scratch(pid: int) -> list[Path]:
    scratch = default_state_dir() / "scratch"
    return [p for p in scratch.iterdir() if p.name.startswith(f"{pid}-")] if scratch.is_dir() else []


def _host_cgroup(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


@pytest.fixture
def pooled(bench: ToolBench) -> Iterator[tuple[ToolBench, str]]:
    name, mark = _marker()
    bench.tool("trace", TRACING_TOOL, env={name: mark})
    bench.policy["tools"] = {"trace": {"pool": 2}}
    yield bench, mark
    wait_for(lambda: _warm_pids(mark) == [], 5.0)


def test_fifty_pooled_calls_each_see_a_fresh_sandbox_and_none_of_the_others(
    pooled: tuple[ToolBench, str],
) -> None:
    bench, mark = pooled
    # Namespace inode numbers are recycled once a namespace is gone, so the proof of a
    # fresh sandbox per call is taken on the host: the process each call took, and the
    # cgroup of every warm sandbox (cgroup names are never reused).
    taken: list[int] = []
    cgroups = call_cgroups()  # rootless on cgroup v1 there are none: the pids prove it alone
    host_cgroups: dict[str, int] = {}  # each host cgroup seen, with the one process it held
    with bench.runner() as runner:
        for n in range(50):
            wait_for(lambda: _idle(runner)["trace"] == 2 and len(_warm_pids(mark)) == 2)
            waiting = set(_warm_pids(mark))
            for pid in waiting if cgroups else ():
                cgroup = _host_cgroup(pid)
                assert host_cgroups.setdefault(cgroup, pid) == pid, "two sandboxes shared a cgroup"
            answer = runner.handle({"toolName": "trace", "params": {"n": n}})
            assert answer["success"], answer
            (gone,) = waiting - set(_warm_pids(mark))
            taken.append(gone)
            seen = answer["result"]
            assert seen["tmp_before"] == [], f"call {n} saw {seen['tmp_before']}"
            # Rootless without cgroups the shim waits beside the tool as pid 2 (``ROOTLESS_SHIM``).
            own = {1, seen["me"]} if cgroups else {1, 2, seen["me"]}
            assert set(seen["pids"]) <= own, f"call {n} saw other processes: {seen['pids']}"
            assert seen["own_file_ok"]
            assert "REQUEST_ID" not in seen["env"]
    assert len(set(taken)) == 50
    assert len(host_cgroups) >= 50 or not cgroups
    attempts = _attempts(bench)
    assert [event["warm"] for event in attempts] == [True] * 50
    assert our_cgroups(os.getpid()) == []


def test_a_warm_call_gets_its_request_id_in_the_context_not_the_environment(
    pooled: tuple[ToolBench, str],
) -> None:
    bench, _ = pooled
    with bench.runner() as runner:
        wait_for(lambda: _idle(runner)["trace"] == 2)
        answer = runner.handle({"toolName": "trace", "requestId": "req-warm-1", "params": {}})
    assert answer["success"], answer
    assert answer["result"]["context"] == {"requestId": "req-warm-1", "toolName": "trace", "attempt": 1}
    assert "REQUEST_ID" not in answer["result"]["env"]
    (attempt,) = _attempts(bench)
    assert attempt["warm"] is True
    assert attempt["requestId"] == "req-warm-1"


def test_the_pool_refills_after_each_call(pooled: tuple[ToolBench, str]) -> None:
    bench, mark = pooled
    with bench.runner() as runner:
        wait_for(lambda: _idle(runner)["trace"] == 2 and len(_warm_pids(mark)) == 2)
        before = set(_warm_pids(mark))
        assert runner.handle({"toolName": "trace"})["success"]
        wait_for(lambda: _idle(runner)["trace"] == 2 and len(_warm_pids(mark)) == 2)
        after = set(_warm_pids(mark))
    assert len(after) == 2
    assert len(before & after) == 1  # one taken and destroyed, one new


def test_a_taken_sandbox_is_replaced_when_its_call_ends_or_soon_after_it_was_taken() -> None:
    # The keeper's rule, on a clock of the test's own (no sandbox is started: the pool's
    # one idle entry is a stand-in). Setting up the replacement takes CPU a short call's
    # own tool needs (docs/performance.md), so it waits for the
    # call's end, but no longer than REFILL_DEFER_S, so that calls arriving during a long
    # one still find a warm sandbox.
    now = [100.0]
    limits = Limits(timeout_ms=1000)
    plan = PoolPlan(1, cast(PreStarts, object()), LaunchSpec("t", "", ("true",), Path("/")), limits)
    pools = WarmPools(warn=print, fault=print, clock=lambda: now[0])
    pool = _Pool(plan)
    pools._pools = {"t": pool}
    pools._max_total, pools._max_idle_s = 10, 60.0

    def take() -> Callable[[], None]:
        pool.idle.append(Ready(cast(WarmSandbox, object()), now[0]))
        taken = pools.take("t", limits)
        assert taken is not None
        return taken[1]

    release = take()
    assert pools._next_job() is None  # its call runs: no replacement yet
    release()
    assert pools._next_job() is pool  # the call ended: replaced at once
    pool.preparing = 0
    take()
    now[0] += REFILL_DEFER_S / 2
    assert pools._next_job() is None
    assert pools._next_wake() == pytest.approx(REFILL_DEFER_S / 2 + 0.001)
    now[0] += REFILL_DEFER_S
    assert pools._next_job() is pool  # a long call: replaced while it still runs


def test_a_call_that_arrives_while_a_long_call_runs_is_still_warm(bench: ToolBench) -> None:
    bench.tool("trace", TRACING_TOOL)
    bench.policy["tools"] = {"trace": {"pool": 1}}
    with bench.runner() as runner, ThreadPoolExecutor(1) as caller:
        wait_for(lambda: _idle(runner)["trace"] == 1)
        long_call = caller.submit(runner.handle, {"toolName": "trace", "params": {"sleep": 3}})
        time.sleep(1.5)  # ample time for a replacement (~50 ms) to be ready
        assert not long_call.done()
        second = runner.handle({"toolName": "trace", "params": {"n": 2}})
        assert second["success"], second
        assert long_call.result(timeout=30)["success"]
    assert [event["warm"] for event in _attempts(bench)] == [True, True]


def test_a_sandbox_idle_past_max_idle_ms_is_replaced(pooled: tuple[ToolBench, str]) -> None:
    bench, mark = pooled
    bench.policy["pool"] = {"max_idle_ms": 300}
    with bench.runner() as runner:
        wait_for(lambda: len(_warm_pids(mark)) == 2)
        first = set(_warm_pids(mark))
        # A replacement's tool runs a moment before its pool counts it ready: both, together.
        wait_for(
            lambda: (
                not first & set(_warm_pids(mark))
                and len(_warm_pids(mark)) == 2
                and _idle(runner)["trace"] == 2
            )
        )


def test_max_total_bounds_warm_sandboxes_over_all_tools(bench: ToolBench) -> None:
    name, mark = _marker()
    for tool in ("one", "two", "three"):
        bench.tool(tool, TRACING_TOOL, env={name: mark})
    bench.policy["pool"] = {"size": 3, "max_total": 4}
    with bench.runner() as runner:
        wait_for(lambda: sum(_idle(runner).values()) == 4)
        time.sleep(0.5)  # the keeper had time to overshoot, were it to
        assert sum(_idle(runner).values()) == 4
        assert len(_warm_pids(mark)) == 4
        assert min(_idle(runner).values()) >= 1  # shared out, not one tool first
    wait_for(lambda: _warm_pids(mark) == [], 5.0)


def test_closing_the_runner_leaves_no_warm_sandbox(pooled: tuple[ToolBench, str]) -> None:
    bench, mark = pooled
    runner = bench.runner()
    wait_for(lambda: _idle(runner)["trace"] == 2)
    assert our_cgroups(os.getpid()) != [] or not call_cgroups()
    runner.close()
    assert _warm_pids(mark) == []
    assert our_cgroups(os.getpid()) == []
    assert _our_scratch(os.getpid()) == []


def test_a_policy_change_drains_the_pools(pooled: tuple[ToolBench, str]) -> None:
    bench, mark = pooled
    with bench.runner() as runner:
        wait_for(lambda: len(_warm_pids(mark)) == 2)
        bench.policy["tools"] = {"trace": {"pool": 0}}
        policy_path = bench.root / "policies.yaml"
        policy_path.write_text(json.dumps(bench.policy))
        runner.policy = Policy.load(policy_path)
        answer = runner.handle({"toolName": "trace"})
        assert answer["success"], answer
        wait_for(lambda: _warm_pids(mark) == [], 5.0)
    assert [event["warm"] for event in _attempts(bench)] == [False]


KEEPER = """
import sys, time
from runner import Runner
runner = Runner.load(tools=sys.argv[1], policies=sys.argv[2], audit_log=sys.argv[3])
while runner.warm_sandboxes().get("trace") != 3:
    time.sleep(0.02)
print("ready", flush=True)
time.sleep(60)
"""


def test_sigkill_of_a_runner_holding_a_pool_leaves_no_process_cgroup_or_scratch(
    pooled: tuple[ToolBench, str],
) -> None:
    bench, mark = pooled
    bench.policy["tools"] = {"trace": {"pool": 3}}
    bench.runner().close()  # writes the policy file
    argv = [sys.executable, "-c", KEEPER, str(bench.tools), str(bench.root / "policies.yaml"), os.devnull]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "ready\n"
        wait_for(lambda: len(_warm_pids(mark)) == 3)
        assert len(our_cgroups(holder.pid)) >= 3 or not call_cgroups()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    wait_for(lambda: _warm_pids(mark) == [], 5.0)
    wait_for(lambda: our_cgroups(holder.pid) == [], 5.0)  # the holder's watchdog sweeps them
    # Its folders go once their sandboxes are gone (without root, their /tmp mounts hold them).
    wait_for(lambda: _our_scratch(holder.pid) == [], 10.0)


def test_the_timeout_counts_from_the_payload_not_from_the_start(pooled: tuple[ToolBench, str]) -> None:
    bench, _ = pooled
    with bench.runner() as runner:
        wait_for(lambda: _idle(runner)["trace"] == 2)
        time.sleep(0.8)  # idle far longer than the call's timeout
        answer = runner.handle({"toolName": "trace", "params": {"sleep": 0.1}, "options": {"timeout": 500}})
    assert answer["success"], answer
    assert [event["warm"] for event in _attempts(bench)] == [True]


def test_a_warm_call_that_times_out_kills_only_its_own_sandbox(pooled: tuple[ToolBench, str]) -> None:
    bench, mark = pooled
    bench.policy["pool"] = {"max_idle_ms": 600000}
    with bench.runner() as runner:
        wait_for(lambda: _idle(runner)["trace"] == 2 and len(_warm_pids(mark)) == 2)
        before = set(_warm_pids(mark))
        answer = runner.handle({"toolName": "trace", "params": {"sleep": 5}, "options": {"timeout": 300}})
        assert answer["error"]["code"] == "TIMEOUT"
        survivors = before & set(_warm_pids(mark))
        assert len(survivors) == 1  # the other warm sandbox, untouched
        wait_for(lambda: _idle(runner)["trace"] == 2)
        assert runner.handle({"toolName": "trace"})["success"]
