"""Session sandboxes on the docker backend, with a real daemon: one container per
(session, tool) kept between the session's calls and never beyond it, a hung call, a
cancelled one, the memory and CPU limits of the whole session, expiry, closing the
runner, secrets and staged workspace writes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, wait_for
from docker import APIClient

pytestmark = pytest.mark.docker

# A notebook of one variable kept in the container's /tmp; its hostname is its container.
# ``hang`` leaves a child behind and ignores its timeout; ``hog`` breaks the memory limit.
COUNTER = """
import json, os, signal, socket, sys, time
params = json.load(sys.stdin)["params"]
path = "/tmp/count"
count = int(open(path).read()) if os.path.exists(path) else 0
count += 1
open(path, "w").write(str(count))
if params.get("hang"):
    if os.fork() == 0:
        time.sleep(600)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
if params.get("burn"):  # CPU time, in this call alone under the limit
    until = time.process_time() + params["burn"]
    while time.process_time() < until:
        pass
if params.get("hog"):
    hoard = bytearray(400 * 1024 * 1024)
    hoard[::4096] = b"x" * len(hoard[::4096])
if params.get("spinner") and os.fork() == 0:  # left running after the call
    os.setsid()
    os.closerange(0, 1024)
    while True:
        pass
home = os.environ.get("HOME", "")
print(json.dumps({"count": count, "host": socket.gethostname(), "home": home}))
"""
PARAMS = {
    "type": "object",
    "properties": {
        "hang": {"type": "boolean"},
        "hog": {"type": "boolean"},
        "burn": {"type": "number"},
        "spinner": {"type": "boolean"},
    },
    "additionalProperties": False,
}
IMAGE = "runner/python-tools:latest"
TIMEOUT_MS = 30000  # a container's start on a loaded machine


@pytest.fixture
def bench_tools(bench: ToolBench, docker_client: APIClient) -> ToolBench:
    bench.tool("dcount", COUNTER, parameters=PARAMS, session=True, sandbox="docker", image=IMAGE)
    bench.tool("dplain", COUNTER, parameters=PARAMS, sandbox="docker", image=IMAGE)
    bench.policy["limits"]["memory_mb"] = 128
    return bench


def _events(bench: ToolBench, name: str) -> list[dict[str, Any]]:
    lines = bench.audit_log.read_text().splitlines() if bench.audit_log.exists() else []
    return [event for event in map(json.loads, lines) if event["event"] == name]


def _answer(answer: Any) -> dict[str, Any]:
    assert answer.success, answer.error
    result: dict[str, Any] = answer.result
    return result


def _ours(client: APIClient, running: bool = False) -> list[str]:
    """Containers of this process: running, or all."""
    from sandboxes.docker._client import LABEL_OWNER

    found = client.containers(all=not running, filters={"label": f"{LABEL_OWNER}={os.getpid()}"})
    return [c["Id"] for c in found]


def test_state_persists_in_one_container_per_session_and_never_reaches_another_or_a_call_outside(
    bench_tools: ToolBench, docker_client: APIClient
) -> None:
    bench = bench_tools

    async def scenario() -> list[str]:
        async with bench.runner() as runner:
            async with runner.session() as first, runner.session() as second:
                one = [_answer(await first.acall("dcount", timeout=TIMEOUT_MS)) for _ in range(3)]
                assert [a["count"] for a in one] == [1, 2, 3]
                assert len({a["host"] for a in one}) == 1  # the same container each call
                other = _answer(await second.acall("dcount", timeout=TIMEOUT_MS))
                assert other["count"] == 1 and other["host"] != one[0]["host"]
                outside = _answer(await runner.acall("dcount", timeout=TIMEOUT_MS))
                assert outside["count"] == 1 and outside["host"] not in (one[0]["host"], other["host"])
                plain = [_answer(await first.acall("dplain", timeout=TIMEOUT_MS))["count"] for _ in range(2)]
                assert plain == [1, 1]  # not a session tool: fresh each call
                assert _answer(await first.acall("dcount", timeout=TIMEOUT_MS))["count"] == 4
                # The two sessions' containers (a finished call's stops just after it).
                wait_for(lambda: len(_ours(docker_client, running=True)) == 2, 10)
                theirs = set(_ours(docker_client, running=True))
                ids = [first.id, second.id]
            assert theirs.isdisjoint(_ours(docker_client))  # removed by the sessions' end
            wait_for(lambda: _ours(docker_client) == [], 15)  # the calls outside: just after
        return ids

    ids = asyncio.run(scenario())
    opened = _events(bench, "session.opened")
    assert sorted(e["sessionId"] for e in opened) == sorted(ids)
    assert {e["sandbox"] for e in opened} == {"docker"}
    closed = _events(bench, "session.closed")
    assert {(e["sessionId"], e["reason"]) for e in closed} == {(i, "ended") for i in ids}
    assert next(e for e in closed if e["sessionId"] == ids[0])["calls"] == 4


def test_a_hung_call_kills_its_container_and_the_next_call_starts_anew(
    bench_tools: ToolBench, docker_client: APIClient
) -> None:
    bench = bench_tools

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            first = _answer(await session.acall("dcount", timeout=TIMEOUT_MS))
            assert first["count"] == 1
            started = time.monotonic()
            hung = await session.acall("dcount", {"hang": True}, timeout=1500)
            assert time.monotonic() - started < 10
            assert not hung.success and hung.error is not None
            assert hung.error.code.value == "TIMEOUT"
            assert _ours(docker_client) == []  # the container, the call's child with it
            answer = await session.acall("dcount", timeout=TIMEOUT_MS)
            assert _answer(answer)["count"] == 1
            assert _answer(answer)["host"] != first["host"]
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [e["reason"] for e in _events(bench, "session.closed")] == ["limit", "ended"]


def test_a_memory_limit_broken_in_a_session_ends_it(bench_tools: ToolBench, docker_client: APIClient) -> None:
    bench = bench_tools

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _answer(await session.acall("dcount", timeout=TIMEOUT_MS))["count"] == 1
            hog = await session.acall("dcount", {"hog": True}, timeout=TIMEOUT_MS)
            assert not hog.success and hog.error is not None
            assert hog.error.details["reason"] == "memory_limit"
            assert "sessionRestarted" not in hog.error.details
            answer = await session.acall("dcount", timeout=TIMEOUT_MS)
            assert _answer(answer)["count"] == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [e["reason"] for e in _events(bench, "session.closed")] == ["limit", "ended"]
    assert _ours(docker_client) == []


def test_cpu_time_adds_up_over_the_session_and_its_breach_ends_it(
    bench_tools: ToolBench, docker_client: APIClient
) -> None:
    bench = bench_tools
    bench.policy["limits"]["cpu_seconds"] = 2

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            first = await session.acall("dcount", {"burn": 1.2}, timeout=TIMEOUT_MS)
            assert _answer(first)["count"] == 1
            second = await session.acall("dcount", {"burn": 1.2}, timeout=TIMEOUT_MS)
            assert not second.success and second.error is not None
            assert second.error.details["reason"] == "cpu_limit"
            alone = await runner.acall("dcount", {"burn": 1.2}, timeout=TIMEOUT_MS)
            assert _answer(alone)["count"] == 1  # outside the session: its own budget
            answer = await session.acall("dcount", timeout=TIMEOUT_MS)
            assert _answer(answer)["count"] == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [e["reason"] for e in _events(bench, "session.closed")] == ["limit", "ended"]


def test_a_spinner_a_call_left_that_passes_the_cpu_budget_between_calls_ends_the_session(
    bench_tools: ToolBench, docker_client: APIClient
) -> None:
    bench = bench_tools
    bench.policy["limits"]["cpu_seconds"] = 2

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _answer(await session.acall("dcount", {"spinner": True}, timeout=TIMEOUT_MS))["count"] == 1
            deadline = time.monotonic() + 30
            while not _events(bench, "session.closed") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert [e["reason"] for e in _events(bench, "session.closed")] == ["limit"]
            assert _ours(docker_client) == []

    asyncio.run(scenario())


def test_an_idle_session_container_is_removed(bench_tools: ToolBench, docker_client: APIClient) -> None:
    bench = bench_tools
    bench.policy["session"] = {"idle_ms": 1000}

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _answer(await session.acall("dcount", timeout=TIMEOUT_MS))["count"] == 1
            assert len(_ours(docker_client)) == 1
            deadline = time.monotonic() + 15
            while not _events(bench, "session.closed") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert _ours(docker_client) == []
            answer = await session.acall("dcount", timeout=TIMEOUT_MS)
            assert _answer(answer)["count"] == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [e["reason"] for e in _events(bench, "session.closed")] == ["idle", "ended"]


def test_closing_the_runner_removes_its_sessions_containers(
    bench_tools: ToolBench, docker_client: APIClient
) -> None:
    bench = bench_tools

    async def scenario() -> None:
        runner = bench.runner()
        session = runner.session()
        await session.__aenter__()
        assert _answer(await session.acall("dcount", timeout=TIMEOUT_MS))["count"] == 1
        assert len(_ours(docker_client)) == 1
        await runner.aclose()
        with pytest.raises(RuntimeError):
            await session.acall("dcount", timeout=TIMEOUT_MS)

    asyncio.run(scenario())
    assert [e["reason"] for e in _events(bench, "session.closed")] == ["runner_closed"]
    assert _ours(docker_client) == []


def test_a_cancelled_call_kills_its_session_container(
    bench_tools: ToolBench, docker_client: APIClient
) -> None:
    bench = bench_tools

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _answer(await session.acall("dcount", timeout=TIMEOUT_MS))["count"] == 1
            hung = asyncio.ensure_future(session.acall("dcount", {"hang": True}, timeout=TIMEOUT_MS))
            (container,) = _ours(docker_client, running=True)
            for _ in range(300):  # until the call hangs: its tool and the child it left
                await asyncio.sleep(0.05)
                top = await asyncio.to_thread(docker_client.top, container)
                if sum(row[-1].startswith("python") for row in top["Processes"]) >= 2:  # not the gate
                    break
            hung.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hung
            assert _ours(docker_client, running=True) == []  # its child and sleeper with it
            answer = await session.acall("dcount", timeout=TIMEOUT_MS)
            assert _answer(answer)["count"] == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [e["reason"] for e in _events(bench, "session.closed")] == ["limit", "ended"]


SHOW_SECRET = """
import hashlib, json, os, sys
sys.stdin.read()
print(json.dumps({"sha256": hashlib.sha256(os.environ.get("API_TOKEN", "").encode()).hexdigest()}))
"""


def test_each_call_in_a_session_gets_its_secret_kept_out_of_the_containers_config(
    bench_tools: ToolBench, docker_client: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = bench_tools
    secret = "s3cr3t-" + os.urandom(8).hex()
    monkeypatch.setenv("RUNNER_TEST_SESSION_SECRET", secret)
    bench.tool("dshow", SHOW_SECRET, session=True, sandbox="docker", image=IMAGE, secrets=["API_TOKEN"])
    bench.policy["secrets"] = {"API_TOKEN": {"env": "RUNNER_TEST_SESSION_SECRET"}}
    bench.policy["tools"] = {"dshow": {"secrets": ["API_TOKEN"]}}

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            for _ in range(2):
                answer = _answer(await session.acall("dshow", timeout=TIMEOUT_MS))
                assert answer["sha256"] == hashlib.sha256(secret.encode()).hexdigest()  # answers redact it
            (container,) = _ours(docker_client, running=True)
            inspected = docker_client.inspect_container(container)
            assert secret not in json.dumps(inspected)
            for exec_id in inspected.get("ExecIDs") or []:
                assert secret not in json.dumps(docker_client.exec_inspect(exec_id))

    asyncio.run(scenario())


APPEND = """
import json, os, sys
sys.stdin.read()
path = os.path.join(os.environ["WORKSPACE"], "log.txt")
before = open(path).read() if os.path.exists(path) else ""
open(path, "a").write("call\\n")
print(json.dumps({"before": before}))
"""


def test_workspace_writes_are_kept_between_a_sessions_calls_and_applied_at_its_end(
    bench_tools: ToolBench, docker_client: APIClient, tmp_path: Path
) -> None:
    bench = bench_tools
    workspace = tmp_path / "ws"
    workspace.mkdir()
    bench.policy["workspace"] = str(workspace)
    bench.tool("dappend", APPEND, session=True, sandbox="docker", image=IMAGE, workspace="write")

    async def scenario() -> None:
        async with bench.runner() as runner:
            async with runner.session() as session:
                seen = [
                    _answer(await session.acall("dappend", timeout=TIMEOUT_MS))["before"] for _ in range(3)
                ]
                assert seen == ["", "call\n", "call\ncall\n"]
            assert (workspace / "log.txt").read_text() == "call\n" * 3

    asyncio.run(scenario())
