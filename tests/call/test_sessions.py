"""Session sandboxes through the Python API, with real sandboxes: state kept within a
session and never beyond it, expiry, limits, a hung call, the bounds, and closing. Run
as root and, by scripts/test-rootless.sh, as an unprivileged user."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from typing import Any

import pytest
import yaml
from conftest import ToolBench, docker_ready, our_cgroups, wait_for

from runner.call.sessions import CallSession
from sandboxes.subprocess._session import SubprocessSession
from sandboxes.testing import processes_with_env

# A notebook of one variable: a count kept in the sandbox's /tmp. ``hang`` leaves a child
# behind and ignores its timeout; ``hog`` breaks the memory limit.
COUNTER = """
import json, os, signal, sys, time
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
if params.get("kill_agent"):  # the process that started this call, in the same sandbox
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(600)
if params.get("kill_agent_later"):  # once this call has answered: the sandbox dies between calls
    agent = os.getppid()
    if os.fork() == 0:
        os.setsid()
        os.closerange(0, 1024)
        time.sleep(1)
        os.kill(agent, signal.SIGKILL)
        os._exit(0)
if params.get("burn"):  # CPU time, in this call alone under the limit
    until = time.process_time() + params["burn"]
    while time.process_time() < until:
        pass
if params.get("hog"):
    hoard = bytearray(400 * 1024 * 1024)
    hoard[::4096] = b"x" * len(hoard[::4096])
for _ in range({"spinners": 2, "hoarders": 4}.get(params.get("leave"), 0)):
    if os.fork() == 0:  # left running after the call: 2 spinners, or 4 x 50 MB
        os.setsid()
        os.closerange(0, 1024)
        if params["leave"] == "hoarders":
            time.sleep(2)  # once the call has ended: its own poll would see them first
            hoard = bytearray(50 * 1024 * 1024)
            hoard[::4096] = b"x" * len(hoard[::4096])
            time.sleep(600)
        while True:
            pass
namespaces = [os.readlink(f"/proc/self/ns/{kind}") for kind in ("net", "mnt", "pid")]
print(json.dumps({"count": count, "pid": os.getpid(), "namespaces": namespaces}))
"""
PARAMS = {
    "type": "object",
    "properties": {
        "hang": {"type": "boolean"},
        "hog": {"type": "boolean"},
        "kill_agent": {"type": "boolean"},
        "kill_agent_later": {"type": "boolean"},
        "burn": {"type": "number"},
        "leave": {"enum": ["spinners", "hoarders"]},
    },
    "additionalProperties": False,
}


def _events(bench: ToolBench, name: str) -> list[dict[str, Any]]:
    lines = bench.audit_log.read_text().splitlines() if bench.audit_log.exists() else []
    return [event for event in map(json.loads, lines) if event["event"] == name]


@pytest.fixture
def mark(bench: ToolBench) -> str:
    value = uuid.uuid4().hex
    bench.tool("counter", COUNTER, parameters=PARAMS, session=True, env={"SESSION_MARK": value})
    bench.tool("plain", COUNTER, parameters=PARAMS, env={"SESSION_MARK": value})
    bench.policy["limits"]["memory_mb"] = 128
    return value


def _count(answer: Any) -> int:
    assert answer.success, answer.error
    return int(answer.result["count"])


def test_state_persists_within_a_session_and_never_reaches_another_or_a_call_outside(
    bench: ToolBench, mark: str
) -> None:
    async def scenario() -> None:
        async with bench.runner() as runner:
            async with runner.session() as first, runner.session() as second:
                answers = [await first.acall("counter") for _ in range(3)]
                assert [_count(answer) for answer in answers] == [1, 2, 3]
                # Each call a new process, in the very namespaces of the one before.
                assert len({answer.result["pid"] for answer in answers}) == 3
                assert len({tuple(answer.result["namespaces"]) for answer in answers}) == 1
                other = await second.acall("counter")
                assert _count(other) == 1
                assert set(other.result["namespaces"]).isdisjoint(answers[0].result["namespaces"])
                assert _count(await runner.acall("counter")) == 1  # outside: fresh
                assert _count(await first.acall("plain")) == 1  # not a session tool
                assert _count(await first.acall("plain")) == 1
                answer = await first.acall("counter")
                assert _count(answer) == 4
                assert "sessionRestarted" not in answer.to_wire()["metadata"]
                ids = (first.id, second.id)
            assert _count(await runner.acall("counter")) == 1

        opened = _events(bench, "session.opened")
        assert sorted(event["sessionId"] for event in opened) == sorted(ids)
        closed = _events(bench, "session.closed")
        assert {(event["sessionId"], event["reason"]) for event in closed} == {(i, "ended") for i in ids}
        assert next(e for e in closed if e["sessionId"] == ids[0])["calls"] == 4
        finished = _events(bench, "call.finished")
        assert sum(1 for event in finished if event.get("sessionId") == ids[0]) == 6
        assert sum(1 for event in finished if "sessionId" not in event) == 2
        attempts = [e for e in _events(bench, "call.attempt") if e.get("sessionId") == ids[1]]
        assert len(attempts) == 1

    asyncio.run(scenario())
    assert processes_with_env(f"SESSION_MARK={mark}") == []
    assert our_cgroups(os.getpid()) == []


def test_a_pooled_session_tool_keeps_its_pool_for_calls_outside_sessions(bench: ToolBench, mark: str) -> None:
    bench.policy["tools"] = {"counter": {"pool": 2}}

    async def scenario() -> None:
        async with bench.runner() as runner:
            wait_for(lambda: runner.warm_sandboxes().get("counter") == 2, 20)
            async with runner.session() as session:
                assert [_count(await session.acall("counter")) for _ in range(2)] == [1, 2]
                outside = [await runner.acall("counter") for _ in range(2)]
                assert [_count(answer) for answer in outside] == [1, 1]
                assert _count(await session.acall("counter")) == 3

    asyncio.run(scenario())
    warm = [event["warm"] for event in _events(bench, "call.attempt") if "sessionId" not in event]
    assert True in warm
    assert processes_with_env(f"SESSION_MARK={mark}") == []


def test_the_policy_marks_a_tool_for_sessions_and_can_unmark_one(bench: ToolBench, mark: str) -> None:
    bench.policy["tools"] = {"plain": {"session": True}, "counter": {"session": False}}

    async def scenario() -> tuple[list[int], list[int]]:
        async with bench.runner() as runner, runner.session() as session:
            plain = [_count(await session.acall("plain")) for _ in range(2)]
            counter = [_count(await session.acall("counter")) for _ in range(2)]
            return plain, counter

    assert asyncio.run(scenario()) == ([1, 2], [1, 1])


async def _closed_reasons(bench: ToolBench, within_s: float = 30.0) -> list[str]:
    """The reasons of ``session.closed`` once there is one (or, after ``within_s``, none)."""
    for _ in range(int(within_s / 0.1)):
        if _events(bench, "session.closed"):
            break
        await asyncio.sleep(0.1)
    return [event["reason"] for event in _events(bench, "session.closed")]


def _slow_sandbox_close(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Each session sandbox's close takes a second more; the event is set as one begins."""
    original = SubprocessSession.close
    began = asyncio.Event()

    async def slow_close(self: SubprocessSession) -> None:
        began.set()
        await asyncio.sleep(1)
        await original(self)

    monkeypatch.setattr(SubprocessSession, "close", slow_close)
    return began


def test_ending_a_session_while_its_sweeper_closes_a_sandbox_waits_for_that_close(
    bench: ToolBench, mark: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The session used to cancel its sweeper and go: a close the sweeper had begun went on
    # after the session (and the runner) ended, and its session.closed line was lost.
    bench.policy["session"] = {"idle_ms": 200}
    began = _slow_sandbox_close(monkeypatch)

    async def scenario() -> None:
        async with bench.runner() as runner:
            async with runner.session() as session:
                assert _count(await session.acall("counter")) == 1
                await asyncio.wait_for(began.wait(), 30)  # the sweeper is closing it
            assert processes_with_env(f"SESSION_MARK={mark}") == []
            assert [event["reason"] for event in _events(bench, "session.closed")] == ["idle"]

    asyncio.run(scenario())


def test_a_sandbox_whose_limits_cannot_be_looked_at_between_calls_is_closed(
    bench: ToolBench, mark: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweeper asked each sandbox whether it had ended outside its guard: one fault
    # there ended the sweeper for good, and no sandbox of the session was looked at again
    # (limits, expiry). Unwatched, it is closed instead; the sweep goes on.
    bench.policy["session"] = {"idle_ms": 60000}
    original = SubprocessSession.ended
    armed, faults = asyncio.Event(), list[int]()

    def ended_once_faulty(self: SubprocessSession) -> Any:
        if armed.is_set() and not faults:
            faults.append(1)
            raise OSError("a read between calls failed")
        return original(self)

    monkeypatch.setattr(SubprocessSession, "ended", ended_once_faulty)

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _count(await session.acall("counter")) == 1
            armed.set()  # the sweeper's next look, between calls
            reasons = await _closed_reasons(bench)
            assert faults
            assert reasons == ["fault"]
            assert processes_with_env(f"SESSION_MARK={mark}") == []  # closed before it is told
            again = await session.acall("counter")
            assert _count(again) == 1
            assert again.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())


def test_the_runner_closing_while_a_session_ends_waits_for_that_end(
    bench: ToolBench, mark: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The session left the runner's list before its close was over: a runner closing
    # meanwhile (another task) ended first, the session's processes still running.
    _slow_sandbox_close(monkeypatch)

    async def scenario() -> None:
        runner = bench.runner()
        session = runner.session().start()
        assert _count(await session.acall("counter")) == 1
        ending = asyncio.ensure_future(session.aclose())
        await asyncio.sleep(0.2)  # the session's close is under way
        await runner.aclose()
        assert processes_with_env(f"SESSION_MARK={mark}") == []
        await ending

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["ended"]


def test_a_session_left_open_is_closed_by_the_runner_from_another_loop(bench: ToolBench, mark: str) -> None:
    # Its loop ended (asyncio.run), or blocked in the runner's synchronous close (a
    # notebook's cell): the close must neither wait for that loop nor fail on it.
    runner = bench.runner()

    async def left_open() -> None:
        session = runner.session().start()
        assert _count(await session.acall("counter")) == 1

    asyncio.run(left_open())
    runner.close()
    assert processes_with_env(f"SESSION_MARK={mark}") == []

    blocked = bench.runner()

    async def cell() -> None:
        session = blocked.session().start()
        assert _count(await session.acall("counter")) == 1
        closing = threading.Thread(target=blocked.close, daemon=True)
        closing.start()
        closing.join(60)  # the loop blocked, as a notebook's synchronous close blocks it
        assert not closing.is_alive(), "the runner's close waited for a blocked loop"

    asyncio.run(cell())
    assert processes_with_env(f"SESSION_MARK={mark}") == []
    reasons = [event["reason"] for event in _events(bench, "session.closed")]
    assert reasons == ["runner_closed", "runner_closed"]


@pytest.mark.parametrize(("settings", "reason"), [({"idle_ms": 1500}, "idle"), ({"max_ms": 3000}, "max_ms")])
def test_an_expired_session_sandbox_is_closed_and_the_next_call_says_it_restarted(
    bench: ToolBench, mark: str, settings: dict[str, int], reason: str
) -> None:
    bench.policy["session"] = settings

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _count(await session.acall("counter")) == 1
            if reason == "max_ms":
                await asyncio.sleep(0.5)
                assert _count(await session.acall("counter")) == 2  # used, but not for long
            deadline = time.monotonic() + 10
            while not _events(bench, "session.closed"):
                assert time.monotonic() < deadline, "the sandbox did not expire"
                await asyncio.sleep(0.05)
            assert processes_with_env(f"SESSION_MARK={mark}") == []  # closed by the sweep
            answer = await session.acall("counter")
            assert _count(answer) == 1
            assert answer.to_wire()["metadata"]["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == [reason, "ended"]
    assert [event["restarted"] for event in _events(bench, "session.opened")] == [False, True]


def test_a_hung_call_ends_its_session_whole_and_the_next_call_starts_anew(
    bench: ToolBench, mark: str
) -> None:
    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _count(await session.acall("counter")) == 1
            hung = await session.acall("counter", {"hang": True}, timeout=1000)
            assert not hung.success and hung.error is not None
            assert hung.error.code.value == "TIMEOUT"
            # The call's child and its sleeping main process, and the session with them.
            wait_for(lambda: processes_with_env(f"SESSION_MARK={mark}") == [], 5)
            again = await session.acall("counter", {"hang": True}, timeout=1000)
            assert again.error is not None
            assert again.error.details["sessionRestarted"] is True  # in a failed call's details
            answer = await session.acall("counter")
            assert _count(answer) == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["limit", "limit", "ended"]


def test_a_limit_broken_in_a_session_ends_it_and_the_failed_call_is_not_a_restart(
    bench: ToolBench, mark: str
) -> None:
    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _count(await session.acall("counter")) == 1
            hog = await session.acall("counter", {"hog": True})
            assert not hog.success and hog.error is not None
            assert hog.error.details["reason"] == "memory_limit"
            assert "sessionRestarted" not in hog.error.details
            answer = await session.acall("counter")
            assert _count(answer) == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["limit", "ended"]


def test_a_tool_that_kills_the_process_that_started_it_only_ends_its_own_session(
    bench: ToolBench, mark: str
) -> None:
    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session, runner.session() as other:
            assert _count(await other.acall("counter")) == 1
            assert _count(await session.acall("counter")) == 1
            broken = await session.acall("counter", {"kill_agent": True}, timeout=20000)
            assert not broken.success and broken.error is not None
            assert broken.error.code.value == "EXECUTION_ERROR"
            assert broken.metadata.duration < 15000  # the orphaned call was not waited for
            answer = await session.acall("counter")
            assert _count(answer) == 1
            assert answer.metadata.extra["sessionRestarted"] is True
            assert _count(await other.acall("counter")) == 2

    asyncio.run(scenario())
    assert processes_with_env(f"SESSION_MARK={mark}") == []


def test_a_session_sandbox_that_dies_between_calls_is_closed_as_died_and_frees_its_place(
    bench: ToolBench, mark: str
) -> None:
    # Its death went unseen: it still counted against session.max_total, and the next
    # call of its session failed (killed by SIGKILL) before the one after restarted.
    bench.policy["session"] = {"max_total": 1}

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _count(await session.acall("counter", {"kill_agent_later": True})) == 1
            for _ in range(200):
                if _events(bench, "session.closed"):
                    break
                await asyncio.sleep(0.05)
            async with runner.session() as other:
                assert _count(await other.acall("counter")) == 1
            answer = await session.acall("counter")
            assert _count(answer) == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["died", "ended", "ended"]
    assert processes_with_env(f"SESSION_MARK={mark}") == []


def test_cpu_time_adds_up_over_the_session_and_its_breach_ends_the_session(
    bench: ToolBench, mark: str
) -> None:
    bench.policy["limits"]["cpu_seconds"] = 2

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            first = await session.acall("counter", {"burn": 1.2}, timeout=20000)
            assert _count(first) == 1
            second = await session.acall("counter", {"burn": 1.2}, timeout=20000)
            assert not second.success and second.error is not None
            assert second.error.details["reason"] == "cpu_limit"
            assert _count(await runner.acall("counter", {"burn": 1.2}, timeout=20000)) == 1  # alone: fine
            answer = await session.acall("counter")
            assert _count(answer) == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["limit", "ended"]


def test_session_bounds_refuse_one_sandbox_too_many_until_one_closes(bench: ToolBench, mark: str) -> None:
    bench.policy["session"] = {"max_total": 1}

    async def scenario() -> None:
        async with bench.runner() as runner:
            async with runner.session() as first:
                assert _count(await first.acall("counter")) == 1
                async with runner.session() as second:
                    refused = await second.acall("counter")
                    assert not refused.success and refused.error is not None
                    assert refused.error.details["reason"] == "sandbox_unavailable"
                    assert "max_total" in refused.error.message
            async with runner.session() as third:
                assert _count(await third.acall("counter")) == 1

    asyncio.run(scenario())


def test_closing_the_runner_closes_its_open_sessions(bench: ToolBench, mark: str) -> None:
    async def scenario() -> None:
        runner = bench.runner()
        session = runner.session()
        await session.__aenter__()
        assert _count(await session.acall("counter")) == 1
        await runner.aclose()
        with pytest.raises(RuntimeError):
            await session.acall("counter")

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["runner_closed"]
    assert processes_with_env(f"SESSION_MARK={mark}") == []
    assert our_cgroups(os.getpid()) == []


EVENTFUL = """
import json, sys
json.load(sys.stdin)
for line in ({"progress": 1, "total": 2, "message": "half"}, {"content": {"type": "text", "text": "note"}}):
    sys.stderr.write("\\x1e" + json.dumps(line) + "\\n")
sys.stderr.write("plain stderr\\n")
print(json.dumps({"ok": True}))
"""


@pytest.mark.parametrize("backend", ["subprocess", "docker"])
def test_a_session_tools_events_stream_as_a_fresh_sandboxs_do(bench: ToolBench, backend: str) -> None:
    if backend == "docker":
        why = docker_ready()
        if why is not None:
            pytest.skip(why)
        bench.tool("eventful", EVENTFUL, session=True, sandbox="docker", image="runner/python-tools:latest")
    else:
        bench.tool("eventful", EVENTFUL, session=True)
    heard: list[dict[str, Any]] = []

    async def scenario() -> list[Any]:
        async with bench.runner() as runner, runner.session() as session:
            return [await session.acall("eventful", on_event=heard.append) for _ in range(2)]

    answers = asyncio.run(scenario())
    for answer in answers:
        assert answer.success, answer.error
        assert answer.content == ({"type": "text", "text": "note"},)
    assert [event.get("progress") for event in heard if "progress" in event] == [1, 1]
    attempts = _events(bench, "call.attempt")
    assert all("\x1e" not in event.get("stderr", "") for event in attempts)


def test_a_reload_opens_session_sandboxes_anew_with_the_new_settings(bench: ToolBench, mark: str) -> None:
    # A session sandbox holds its first call's limits, grants and code: after a reload it
    # must not go on with the old ones.
    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert [_count(await session.acall("counter")) for _ in range(2)] == [1, 2]
            bench.policy["limits"]["memory_mb"] = 96
            policy_file = bench.root / "policies.yaml"
            policy_file.write_text(yaml.safe_dump(bench.policy))
            runner.reload([bench.tools], policy_file)
            again = await session.acall("counter")
            assert _count(again) == 1
            assert again.to_wire()["metadata"]["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["reloaded", "ended"]


@pytest.mark.parametrize("left", ["spinners", "hoarders"])
def test_processes_a_call_left_that_pass_a_limit_between_calls_end_the_session(
    bench: ToolBench, mark: str, left: str
) -> None:
    # Nothing polls a session's limits while no call runs but the sandbox itself: left
    # alone, spinners used CPU until idle_ms, and rootless hoarders held any memory. Two
    # spinners: rootless, one alone is stopped by its own CPU rlimit, the same budget, when
    # the sum of the tree's times (in clock ticks) may still read just under it.
    bench.policy["limits"]["cpu_seconds"] = 2

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _count(await session.acall("counter", {"leave": left})) == 1
            assert await _closed_reasons(bench) == ["limit"]
            for _ in range(100):
                if not processes_with_env(f"SESSION_MARK={mark}"):
                    break
                await asyncio.sleep(0.05)
            assert processes_with_env(f"SESSION_MARK={mark}") == []
            answer = await session.acall("counter")
            assert _count(answer) == 1
            assert answer.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())


def test_a_reload_closes_session_sandboxes_even_of_a_tool_no_longer_called(
    bench: ToolBench, mark: str
) -> None:
    # A tool the new policy refuses is never called again in the session: its sandbox
    # (its secrets, its background processes) must not wait for idle_ms to go.
    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            assert _count(await session.acall("counter")) == 1
            bench.policy["whitelist"] = ["plain"]
            policy_file = bench.root / "policies.yaml"
            policy_file.write_text(yaml.safe_dump(bench.policy))
            runner.reload([bench.tools], policy_file)
            refused = await session.acall("counter")
            assert refused.error is not None and refused.error.code.value == "PERMISSION_DENIED"
            # The processes die inside the sandbox's close; the event is written after it.
            for _ in range(200):
                if not processes_with_env(f"SESSION_MARK={mark}") and _events(bench, "session.closed"):
                    break
                await asyncio.sleep(0.05)
            assert processes_with_env(f"SESSION_MARK={mark}") == []
            assert [event["reason"] for event in _events(bench, "session.closed")] == ["reloaded"]

    asyncio.run(scenario())


def test_a_sandbox_opened_by_a_call_that_began_before_a_reload_is_closed_after_it(
    bench: ToolBench, mark: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reload lands while the first call is on its way (its policy read, its sandbox not
    # yet opened): the sandbox it opens holds the old settings, and was taken as current.
    original = CallSession.take
    reloaded: list[bool] = []

    async def take(self: CallSession, *args: Any) -> Any:
        if not reloaded:
            reloaded.append(True)
            bench.policy["limits"]["memory_mb"] = 96
            policy_file = bench.root / "policies.yaml"
            policy_file.write_text(yaml.safe_dump(bench.policy))
            runner.reload([bench.tools], policy_file)
        return await original(self, *args)

    monkeypatch.setattr(CallSession, "take", take)
    runner = bench.runner()

    async def scenario() -> None:
        async with runner, runner.session() as session:
            assert _count(await session.acall("counter")) == 1
            await asyncio.sleep(1.2)  # more than the sweep's half second
            again = await session.acall("counter")
            assert _count(again) == 1
            assert again.metadata.extra["sessionRestarted"] is True

    asyncio.run(scenario())
    assert [event["reason"] for event in _events(bench, "session.closed")] == ["reloaded", "ended"]
