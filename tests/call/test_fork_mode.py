"""Fork mode (``pool: {mode: fork}``), with real templates and real calls: each call is
forked from the tool's frozen template into a fresh sandbox, under the call's limits, and
nothing of it is left after it; a tool that cannot run so is served warm, said so.

Runs as root on a kernel that tells a process's exit status through its pidfd (6.15 and
later), on x86-64: elsewhere fork mode refuses (``test_a_machine_without_fork_mode...``)."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ToolBench, our_cgroups, wait_for

from runner import Runner
from sandboxes.subprocess._forked import exit_status_known
from sandboxes.testing import processes_with_env

FORKABLE = os.geteuid() == 0 and os.uname().machine == "x86_64" and exit_status_known()
needs_fork_mode = pytest.mark.skipif(not FORKABLE, reason="fork mode needs root, x86-64 and Linux 6.15+")

# What a call sees, and leaves behind for the next one to find: a file in /tmp, a child
# that stays, a module global of an imported module changed.
TRACING = """
import json, os, sys, time
import state
request = json.load(sys.stdin)
params = request["params"]
state.seen.append(params.get("n", 0))
found = sorted(os.listdir("/tmp"))
open(f"/tmp/left-{params.get('n', 0)}", "w").close()
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print(json.dumps({
    "me": os.getpid(),
    "uid": os.getuid(),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "tmp": found,
    "seen": state.seen,
    "imported_at": state.imported_at,
    "request": request["context"].get("requestId"),
}))
"""

LIMITS = """
import json, os, sys, time
params = json.load(sys.stdin)["params"]
what = params["what"]
if what == "sleep":
    time.sleep(60)
elif what == "spin":
    while True:
        pass
elif what == "memory":
    hoard = []
    while True:
        hoard.append(bytearray(16 * 1024 * 1024))
elif what == "output":
    sys.stdout.write("x" * (4 * 1024 * 1024))
elif what == "fork":
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
elif what == "exit":
    sys.exit(3)
print(json.dumps({"what": what}))
"""


def _marker() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def forked(bench: ToolBench) -> Iterator[tuple[ToolBench, str]]:
    mark = _marker()
    bench.tool("trace", TRACING, env={"FORK_MARK": mark})
    (bench.tools / "trace" / "state.py").write_text("import time\nseen = []\nimported_at = time.time()\n")
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    yield bench, mark
    wait_for(lambda: processes_with_env(f"FORK_MARK={mark}") == [], 10.0)


def _ready(runner: Runner, tool: str) -> None:
    runner.warm_sandboxes()  # the pools follow the policy
    wait_for(lambda: runner.warm_sandboxes().get(tool) == 1, 30.0)


@needs_fork_mode
def test_each_call_is_forked_from_one_template_into_a_sandbox_of_its_own(
    forked: tuple[ToolBench, str],
) -> None:
    bench, mark = forked
    with bench.runner() as runner:
        _ready(runner, "trace")
        (template,) = processes_with_env(f"FORK_MARK={mark}")
        answers = [runner.call("trace", {"n": n}) for n in range(6)]
        # Nothing of a call outlives it: the template alone is left.
        wait_for(lambda: processes_with_env(f"FORK_MARK={mark}") == [template], 10.0)
        assert runner._pools.takes()["trace"] == (6, 0)
    for n, answer in enumerate(answers):
        assert answer.success, answer.error
        result = answer.result
        assert result["me"] == 1 and result["pids"] == [1, 2]  # pid 1 of its own namespace, and its child
        assert result["uid"] == 65534
        assert result["tmp"] == []  # no earlier call's file
        assert result["seen"] == [n]  # no earlier call's state: a fresh copy of the template's
    # Imported once, in the template, before any call.
    assert len({answer.result["imported_at"] for answer in answers}) == 1


@needs_fork_mode
def test_a_forked_call_meets_its_limits_and_is_gone_after_each(bench: ToolBench) -> None:
    mark = _marker()
    bench.tool("limited", LIMITS, env={"FORK_MARK": mark}, limits={"timeout_ms": 2000, "memory_mb": 128,
               "cpu_seconds": 1, "max_pids": 32, "max_output_bytes": 1024 * 1024})  # fmt: skip
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    with bench.runner() as runner:
        _ready(runner, "limited")
        (template,) = processes_with_env(f"FORK_MARK={mark}")
        reasons: dict[str, Any] = {}
        for what in ("sleep", "spin", "memory", "output", "fork", "exit", "fine"):
            answer = runner.call("limited", {"what": what})
            error = answer.error
            reasons[what] = (
                (error.code.value, error.details.get("reason")) if error is not None else answer.result
            )
            assert processes_with_env(f"FORK_MARK={mark}") == [template], what
            assert our_cgroups(os.getpid()) == [], what  # each call's cgroup is gone with it
    assert reasons == {
        "sleep": ("TIMEOUT", None),
        "spin": ("EXECUTION_ERROR", "cpu_limit"),
        "memory": ("EXECUTION_ERROR", "memory_limit"),
        "output": ("EXECUTION_ERROR", "output_limit"),
        "fork": ("EXECUTION_ERROR", "pids_limit"),
        "exit": ("EXECUTION_ERROR", "exit_code"),
        "fine": {"what": "fine"},
    }
