"""Warm hosted MCP servers initialized ahead, both backends, with the tests'
own server (``support/servers/stateful_mcp.py``): a pooled call finds its server initialized
before the call was made and says only ``tools/call``; each call still meets a fresh
server; a server that fails its handshake ahead (silent, or garbage instead of its
answer) is never handed out, calls run cold, and nothing of it is left after close.

A warm sandbox has no ``REQUEST_ID``: each test's server carries a marker of its own in
the manifest's ``env`` and is found by it in ``/proc``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, wait_for
from test_hosted import add_server, docker_manifest

from runner import Runner
from sandboxes import LaunchSpec, Limits, OpeningFailed, OpeningPipe
from sandboxes.subprocess.sandbox import SubprocessSandbox
from sandboxes.testing import processes_with_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hardened sandbox runs as root here")


@pytest.fixture(params=["subprocess", "docker"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    return {} if request.param == "subprocess" else docker_manifest()


def pooled_server(bench: ToolBench, backend: dict[str, Any], *args: str, **manifest: Any) -> str:
    """A server whose ``st_count`` has a pool of 1; its marker."""
    mark = uuid.uuid4().hex
    command = ["python3", "server.py", *args]
    add_server(bench, command=command, env={"POOL_MARK": mark}, **backend, **manifest)
    bench.policy["pool"] = {"max_total": 2}
    bench.policy["tools"] = {"st_count": {"pool": 1}}
    bench.policy["audit"] = {"operator_log": "operator.log"}
    return mark


def idle(runner: Runner) -> int:
    return runner.warm_sandboxes().get("st_count", 0)


def attempts_warm(bench: ToolBench) -> list[bool]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [event["warm"] for event in events if event["event"] == "call.attempt"]


def operator_log(bench: ToolBench) -> str:
    path = bench.root / "operator.log"
    return path.read_text() if path.exists() else ""


def leftovers(mark: str) -> list[int]:
    return processes_with_env(f"POOL_MARK={mark}")


def containers_of_this_runner() -> set[str]:
    from sandboxes.docker._client import LABEL_OWNER, api_client

    found = api_client().containers(all=True, filters={"label": f"{LABEL_OWNER}={os.getpid()}"})
    return {container["Id"] for container in found}


def test_ten_pooled_calls_each_find_a_fresh_server_initialized_before_the_call(
    bench: ToolBench, backend: dict[str, Any]
) -> None:
    mark = pooled_server(bench, backend)
    with bench.runner() as runner:
        for _ in range(10):
            wait_for(lambda: idle(runner) >= 1, 30)
            asked_at = time.time()
            answer = runner.call("st_count")
            assert answer.success, answer.error
            seen = json.loads(answer.result)
            # One initialize, said before the call was made: the call said only tools/call.
            assert (seen["count"], seen["markerSeen"], seen["initializes"]) == (1, False, 1), seen
            assert seen["initializedAt"] < asked_at
    warm = attempts_warm(bench)
    assert len(warm) == 10 and all(warm), warm
    wait_for(lambda: leftovers(mark) == [], 5)


def test_what_a_primed_server_wrote_on_stderr_is_in_its_calls_tail(
    bench: ToolBench, backend: dict[str, Any]
) -> None:
    pooled_server(bench, backend)
    bench.policy["tools"] = {"st_die": {"pool": 1}}
    with bench.runner() as runner:
        wait_for(lambda: runner.warm_sandboxes().get("st_die", 0) >= 1, 30)
        answer = runner.call("st_die")
    assert answer.error is not None
    wire = answer.error.to_wire()
    assert (wire["code"], wire["details"]["reason"]) == ("EXECUTION_ERROR", "exit_code"), wire
    # Written while it was initialized ahead, before its call existed.
    assert "initialize seen (1)" in wire["details"]["stderr"]
    assert attempts_warm(bench) == [True]


@pytest.mark.parametrize(
    ("behaviour", "why"),
    [("mute", "did not answer within 3000 ms"), ("garbage", "not JSON-RPC: 'Welcome! this is not json'")],
)
def test_a_server_that_fails_its_handshake_ahead_is_never_handed_out_and_calls_run_cold(
    bench: ToolBench, backend: dict[str, Any], behaviour: str, why: str
) -> None:
    mark = pooled_server(bench, backend, f"--when-warm={behaviour}", limits={"timeout_ms": 3000})
    with bench.runner() as runner:
        # The first failed handshake is reported (once), and the server discarded.
        wait_for(lambda: "could not be initialized ahead" in operator_log(bench), 30)
        assert why in operator_log(bench)
        assert idle(runner) == 0
        for _ in range(2):
            asked_at = time.time()
            answer = runner.call("st_count")
            assert answer.success, answer.error
            seen = json.loads(answer.result)
            # Started and initialized cold, for this call (a cold one answers initialize).
            assert seen["initializes"] == 1 and seen["initializedAt"] > asked_at, seen
            assert idle(runner) == 0
        # The pool kept trying (after its back-off) and kept failing: one warning only.
        time.sleep(0.2)
    assert operator_log(bench).count("could not be initialized ahead") == 1
    assert attempts_warm(bench) == [False, False]
    wait_for(lambda: leftovers(mark) == [], 5)
    if backend:
        assert containers_of_this_runner() == set()


class _ReadToTheEnd:
    """An opening that reads whatever the tool writes, to its end."""

    def open(self, pipe: OpeningPipe, timeout_s: float) -> bytes:
        while pipe.receive(timeout_s):
            pass
        raise OpeningFailed("the end came")


def test_what_a_tool_writes_while_primed_counts_against_max_output_bytes(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.mkdir()
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n    sys.stdout.flush()\n"
    (tool / "main.py").write_text(flood)
    mark = uuid.uuid4().hex
    spec = LaunchSpec("flood", "", ("python3", "main.py"), tool, env={"POOL_MARK": mark})
    limits = Limits(timeout_ms=5000, max_output_bytes=200_000)
    warm = SubprocessSandbox().prestart(spec, limits)
    try:
        started = time.monotonic()
        with pytest.raises(OpeningFailed, match="more than max_output_bytes"):
            warm.prime(_ReadToTheEnd(), 5.0)
        assert time.monotonic() - started < 4.0
    finally:
        warm.discard()
    wait_for(lambda: leftovers(mark) == [], 5)


def test_closing_the_runner_cuts_short_a_handshake_that_hangs(
    bench: ToolBench, backend: dict[str, Any]
) -> None:
    mark = pooled_server(bench, backend, "--when-warm=mute", limits={"timeout_ms": 20000})
    runner = bench.runner()
    try:
        wait_for(lambda: leftovers(mark) != [], 30)
        time.sleep(0.5)  # its import done: the keeper waits for its answer now
    finally:
        started = time.monotonic()
        runner.close()
        closed_in = time.monotonic() - started
    assert closed_in < 5.0  # not the 20 s the handshake had
    assert "could not be initialized ahead" not in operator_log(bench)
    wait_for(lambda: leftovers(mark) == [], 5)
    if backend:
        assert containers_of_this_runner() == set()
