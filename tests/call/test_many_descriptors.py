"""A runner with more descriptors open than ``select`` takes (1024), as a busy server has:
its calls, cold, warm and forked, still run (every wait on a descriptor polls)."""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterator

import pytest
from conftest import ToolBench, wait_for
from support.fork_probes import needs_fork_mode

ADD = "import json, sys\nparams = json.load(sys.stdin)['params']\nprint(json.dumps(params['a'] + params['b']))\n"
HELD = 1100  # the call's own descriptors are numbered past these


@pytest.fixture
def crowded() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = HELD + 1024
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"this process may open {hard} descriptors at most")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    null = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(null) for _ in range(HELD)]
    try:
        yield
    finally:
        for fd in (null, *held):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    "mode",
    [
        "cold",
        "warm",
        pytest.param("fork", marks=needs_fork_mode),
    ],
)
def test_calls_run_with_descriptors_numbered_past_1024(bench: ToolBench, crowded: None, mode: str) -> None:
    # select() raised ValueError on them: a warm sandbox never became ready, a template
    # never froze.
    bench.tool("add", ADD)
    if mode != "cold":
        bench.policy["pool"] = {"size": 1, "mode": mode}
    with bench.runner() as runner:
        if mode != "cold":
            wait_for(lambda: runner.warm_sandboxes().get("add") == 1, 30.0)
        answer = runner.call("add", {"a": 1, "b": 2})
    assert answer.success, answer.error
    assert answer.result == 3
    (attempt,) = [
        json.loads(line) for line in bench.audit_log.read_text().splitlines() if '"call.attempt"' in line
    ]
    assert attempt.get("forked", False) is (mode == "fork")
