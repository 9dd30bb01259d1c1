"""Fork mode (``pool: {mode: fork}``), with real templates and real calls: each call is
forked from the tool's frozen template into a fresh sandbox, under the call's limits, and
nothing of it is left after it; a tool that cannot run so is served warm, said so.

Runs as root on a kernel that tells a process's exit status through its pidfd (6.15 and
later), on x86-64: elsewhere fork mode is refused and the tool served warm
(``test_a_tool_without_fork_mode_is_served_warm_and_the_operator_hears_why``)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import stat
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import ToolBench, wait_for
from support.fork_probes import FORKABLE, needs_fork_mode, running_with, spare_of, status_of
from support.state_folders import passable_folder

from runner import Runner
from sandboxes.testing import processes_with_env

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
    "started": int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]),
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
elif what == "child_memory":  # the parent waits on: only the poll sees the OOM kill
    if os.fork() == 0:
        hoard = []
        while True:
            hoard.append(bytearray(16 * 1024 * 1024))
    time.sleep(60)
elif what == "loopback":
    import socket
    server = socket.create_server(("127.0.0.1", 0))
    socket.create_connection(server.getsockname()).sendall(b"ok")
    print(json.dumps({"what": server.accept()[0].recv(2).decode()}))
    sys.exit(0)
elif what == "nap":
    time.sleep(1.5)
elif what == "group":  # a signal to every process in its process group, then gone
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(params["after"])
    # SIGINT: Python's handler acts in whichever call gets it (SIG_DFL ones do not act
    # in pid 1 of a namespace, when sent from outside it).
    os.kill(0, signal.SIGINT if params["signal"] == "int" else signal.SIGKILL)
elif what == "exit":
    sys.exit(3)
elif what == "write_stdin":  # as with a pipe: its stdin is not for writing
    try:
        os.write(0, b"x" * 300000)
    except OSError as exc:
        print(json.dumps({"what": what, "errno": exc.errno}))
        sys.exit(0)
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
    wait_for(lambda: runner.warm_sandboxes().get(tool) == 1, 30.0)


def _recording_cgroups(runner: Runner) -> list[Path]:
    """The folders of every cgroup ``runner``'s subprocess backend makes from now on."""
    factory = runner._sandbox_factory("subprocess").cgroups  # type: ignore[attr-defined]
    made: list[Path] = []
    create = factory.create

    def recording(memory_mb: int, max_pids: int) -> Any:
        group = create(memory_mb, max_pids)
        made.extend(group.dirs)
        return group

    factory.create = recording
    return made


def _left_but_the_spares(made: list[Path], mark: str) -> list[Path]:
    """The cgroups of ``made`` that are still there, but the spare's (it holds the spare
    alone)."""
    spare = [str(pid) for pid in spare_of(processes_with_env(f"FORK_MARK={mark}"))]
    left = []
    for folder in made:
        try:
            if (folder / "cgroup.procs").read_text().split() != spare or not spare:
                left.append(folder)
        except OSError:
            pass  # removed meanwhile
    return left


def _template(runner: Runner, tool: str, mark: str) -> int:
    """The pid of ``tool``'s template, once it is ready (the only process with ``mark``
    but the spare, the first call's process made ahead)."""
    _ready(runner, tool)
    (template,) = running_with(mark)
    return template


@needs_fork_mode
def test_each_call_is_forked_from_one_template_into_a_sandbox_of_its_own(
    forked: tuple[ToolBench, str],
) -> None:
    bench, mark = forked
    with bench.runner() as runner:
        template = _template(runner, "trace", mark)
        answers = [runner.call("trace", {"n": n}) for n in range(6)]
        # Nothing of a call outlives it: the template alone is left.
        wait_for(lambda: running_with(mark) == [template], 10.0)
        assert runner._pools.takes()["trace"] == (6, 0)
    attempts = [
        json.loads(line) for line in bench.audit_log.read_text().splitlines() if '"call.attempt"' in line
    ]
    assert [(event["warm"], event.get("forked")) for event in attempts] == [(True, True)] * 6
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
def test_a_template_is_the_first_sandbox_a_fresh_state_folder_serves(
    forked: tuple[ToolBench, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # On a fresh boot nothing had made the folder of calls' scratch folders: a template
    # asked for first failed to start, and its tool was served warm. Made, it must let
    # the template's uid pass whatever the runner's umask (systemd's unit: 0077).
    bench, mark = forked
    state = passable_folder(tmp_path, request) / "state"
    bench.policy["sandbox"] = {"backends": {"subprocess": {"state_dir": str(state)}}}
    previous = os.umask(0o077)
    try:
        with bench.runner() as runner:
            _template(runner, "trace", mark)
            answer = runner.call("trace", {"n": 0})
        assert answer.success, answer.error
        (attempt,) = [
            json.loads(line) for line in bench.audit_log.read_text().splitlines() if '"call.attempt"' in line
        ]
        assert attempt.get("forked") is True
    finally:
        os.umask(previous)


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _held(pid: int) -> bool:
    """Whether ``pid`` is stopped by its tracer with no capability left."""
    try:
        fields = status_of(pid)
    except OSError:
        return False
    return fields["State"].startswith("t") and int(fields["CapEff"], 16) == 0


@needs_fork_mode
def test_the_next_calls_process_is_made_ahead_and_held_before_its_first_instruction(
    forked: tuple[ToolBench, str],
) -> None:
    """Made from the template before its call exists, stopped by its tracer until a call
    takes it; the call then runs in it, with nothing of an earlier call's."""
    bench, mark = forked
    with bench.runner() as runner:
        _template(runner, "trace", mark)
        for n in range(3):
            # Seen once its set-up is over: no capability left (its last step), stopped.
            wait_for(lambda: any(map(_held, spare_of(processes_with_env(f"FORK_MARK={mark}")))), 10.0)
            (spare,) = spare_of(processes_with_env(f"FORK_MARK={mark}"))
            assert psutil.Process(spare).status() == psutil.STATUS_TRACING_STOP
            assert (
                Path(f"/proc/{spare}/cgroup").read_text() != Path(f"/proc/{os.getpid()}/cgroup").read_text()
            )
            started = _start_time(spare)
            answer = runner.call("trace", {"n": n})
            assert answer.success, answer.error
            assert answer.result["started"] == started  # the call ran in it
            assert answer.result["seen"] == [n] and answer.result["tmp"] == []
    # Closed: the spare went with the template.
    wait_for(lambda: processes_with_env(f"FORK_MARK={mark}") == [], 10.0)


@needs_fork_mode
def test_a_forked_call_meets_its_limits_and_is_gone_after_each(bench: ToolBench) -> None:
    mark = _marker()
    bench.tool("limited", LIMITS, env={"FORK_MARK": mark}, limits={"timeout_ms": 2000, "memory_mb": 128,
               "cpu_seconds": 1, "max_pids": 32, "max_output_bytes": 1024 * 1024})  # fmt: skip
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    with bench.runner() as runner:
        template = _template(runner, "limited", mark)
        # This runner's own cgroups (runners other tests left open may make some meanwhile).
        templates_own = runner._pools._forks._forks["limited"].template._group.dirs  # type: ignore[union-attr]
        assert len(templates_own) == (3 if os.path.exists("/sys/fs/cgroup/pids/tasks") else 1)  # its imports'
        calls_own = _recording_cgroups(runner)
        reasons: dict[str, Any] = {}
        for what in (
            "sleep",
            "spin",
            "memory",
            "child_memory",
            "output",
            "fork",
            "exit",
            "loopback",
            "write_stdin",
            "fine",
        ):
            answer = runner.call("limited", {"what": what})
            error = answer.error
            reasons[what] = (
                (error.code.value, error.details.get("reason")) if error is not None else answer.result
            )
            assert running_with(mark) == [template], what
            # Each call's is gone with it (removed by the backend's teardown thread just
            # after); the spare's alone is left.
            wait_for(lambda: _left_but_the_spares(calls_own, mark) == [], 10.0)
        assert len(calls_own) >= 8  # one call's may have been made before they were recorded
    wait_for(lambda: not [d for d in templates_own if d.exists()], 10.0)  # the template's with it
    assert reasons == {
        "sleep": ("TIMEOUT", None),
        "spin": ("EXECUTION_ERROR", "cpu_limit"),
        "memory": ("EXECUTION_ERROR", "memory_limit"),
        "child_memory": ("EXECUTION_ERROR", "memory_limit"),
        "output": ("EXECUTION_ERROR", "output_limit"),
        "fork": ("EXECUTION_ERROR", "pids_limit"),
        "exit": ("EXECUTION_ERROR", "exit_code"),
        "loopback": {"what": "ok"},
        "write_stdin": {"what": "write_stdin", "errno": errno.EPIPE},
        "fine": {"what": "fine"},
    }


EVENTFUL = """
from runner_tool import progress, run


def main(params, context):
    for done in range(3):
        progress(done, 3, f"step {done}")
    return {"done": 3}


if __name__ == "__main__":
    run(main)
"""


@needs_fork_mode
def test_a_forked_call_streams_its_events_and_answers_through_the_helper(bench: ToolBench) -> None:
    bench.tool("eventful", EVENTFUL)
    bench.policy["tools"] = {"eventful": {"pool": 1, "pool_mode": "fork"}}
    with bench.runner() as runner:
        _ready(runner, "eventful")
        heard: list[Any] = []
        answer = runner.call("eventful", {}, on_event=heard.append)
        assert runner._pools.takes()["eventful"] == (1, 0)
    assert answer.success and answer.result == {"done": 3}, answer.error
    assert [event.get("progress") for event in heard if isinstance(event, dict)] == [0, 1, 2], heard


@needs_fork_mode
def test_sixteen_callers_at_once_each_get_their_own_answer(forked: tuple[ToolBench, str]) -> None:
    bench, _ = forked
    with bench.runner() as runner:
        _ready(runner, "trace")
        with ThreadPoolExecutor(16) as callers:
            answers = list(callers.map(lambda n: runner.call("trace", {"n": n}), range(64)))
        assert runner._pools.takes()["trace"] == (64, 0)
    assert [answer.error.message for answer in answers if answer.error] == []
    assert [answer.result["seen"] for answer in answers] == [[n] for n in range(64)]
    assert all(answer.result["tmp"] == [] for answer in answers)


@needs_fork_mode
def test_a_cancelled_call_leaves_nothing_and_the_template_serves_the_next(bench: ToolBench) -> None:
    mark = _marker()
    bench.tool("limited", LIMITS, env={"FORK_MARK": mark}, limits={"timeout_ms": 30000})
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    with bench.runner() as runner:
        template = _template(runner, "limited", mark)

        async def cancel_one() -> None:
            call = asyncio.ensure_future(runner.acall("limited", {"what": "sleep"}))
            await asyncio.to_thread(wait_for, lambda: len(running_with(mark)) == 2, 10.0)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

        asyncio.run(cancel_one())
        assert running_with(mark) == [template]  # gone before the cancel came back
        assert runner.call("limited", {"what": "fine"}).result == {"what": "fine"}


@needs_fork_mode
def test_calls_cancelled_while_they_are_forked_leave_nothing_and_the_template_serves_on(
    bench: ToolBench,
) -> None:
    mark = _marker()
    bench.tool("limited", LIMITS, env={"FORK_MARK": mark}, limits={"timeout_ms": 30000})
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    with bench.runner() as runner:
        template = _template(runner, "limited", mark)
        calls_own = _recording_cgroups(runner)

        async def cancel_while_forking(after_s: float) -> None:
            calls = [asyncio.ensure_future(runner.acall("limited", {"what": "sleep"})) for _ in range(8)]
            await asyncio.sleep(after_s)  # some waiting for the tracer, one being set up, some running
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

        for after_s in (0.0, 0.002, 0.005, 0.01, 0.02):
            asyncio.run(cancel_while_forking(after_s))
            wait_for(lambda: running_with(mark) == [template], 10.0)
        hits = runner._pools.takes()["limited"][0]
        assert runner.call("limited", {"what": "fine"}).result == {"what": "fine"}
        assert runner._pools.takes()["limited"][0] == hits + 1  # the same template served it
        assert running_with(mark) == [template]
    wait_for(lambda: not [d for d in calls_own if d.exists()], 10.0)  # none left by a cancel


@needs_fork_mode
def test_a_template_killed_from_outside_is_replaced_and_calls_meanwhile_start_cold(
    forked: tuple[ToolBench, str],
) -> None:
    bench, mark = forked
    with bench.runner() as runner:
        template = _template(runner, "trace", mark)
        os.kill(template, signal.SIGKILL)
        wait_for(lambda: runner.warm_sandboxes().get("trace") == 0 or not psutil.pid_exists(template), 10.0)
        answer = runner.call("trace", {"n": 1})  # finds the template dead: starts cold
        assert answer.success and answer.result["me"] != 1, answer.error
        events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
        (lost,) = [event for event in events if event["event"] == "pool.discarded"]
        assert lost["reason"] == "ended" and lost["toolName"] == "trace"
        assert lost["retryAfterMs"] > 0


@needs_fork_mode
def test_each_template_runs_as_a_leased_uid_of_its_own_as_do_its_calls(bench: ToolBench) -> None:
    from sandboxes._identity import UID_BASE, UID_COUNT

    marks = {name: _marker() for name in ("one", "two")}
    for name, mark in marks.items():
        bench.tool(name, LIMITS, env={"FORK_MARK": mark})
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    uids = {}
    with bench.runner() as runner:
        for name, mark in marks.items():
            _ready(runner, name)

            async def hold(tool: str = name, mark: str = mark) -> set[int]:
                call = asyncio.ensure_future(runner.acall(tool, {"what": "sleep"}, timeout=2000))
                await asyncio.to_thread(wait_for, lambda: len(running_with(mark)) == 2, 10.0)
                seen = {psutil.Process(pid).uids().real for pid in running_with(mark)}
                await call
                return seen

            (uids[name],) = asyncio.run(hold())
    assert uids["one"] != uids["two"]
    assert all(UID_BASE <= uid < UID_BASE + UID_COUNT for uid in uids.values())


def _warned(capfd: pytest.CaptureFixture[str], said: list[str], text: str) -> bool:
    said.append(capfd.readouterr().err)
    return text in "".join(said)


@pytest.mark.parametrize("shell", [False, True], ids=["python", "shell"])
def test_a_tool_without_fork_mode_is_served_warm_and_the_operator_hears_why(
    bench: ToolBench, capfd: pytest.CaptureFixture[str], shell: bool
) -> None:
    if not shell and FORKABLE:
        pytest.skip("this machine has fork mode: a Python tool gets it")
    if shell:  # no fork mode for it on any machine
        bench.tool("limited", "", command=["sh", "-c", 'cat >/dev/null; echo \'{"what": "fine"}\''])
    else:
        bench.tool("limited", LIMITS)
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    said: list[str] = []
    with bench.runner() as runner:
        wait_for(lambda: _warned(capfd, said, "limited cannot run in fork mode"), 30.0)
        wait_for(lambda: runner.warm_sandboxes().get("limited") == 1, 30.0)  # a warm sandbox instead
        answer = runner.call("limited", {"what": "fine"})
        assert runner._pools.takes()["limited"] == (1, 0)
    assert answer.success and answer.result == {"what": "fine"}, answer.error
    why = "python3 SCRIPT.py" if shell else "fork mode needs"
    assert why in "".join(said), said
    attempts = [
        json.loads(line) for line in bench.audit_log.read_text().splitlines() if '"call.attempt"' in line
    ]
    assert [(event["warm"], event.get("forked")) for event in attempts] == [(True, None)]


# Imports that break the tool's limits, or leave the template where a call would start.
BAD_IMPORTS = {
    "memory": "hoard = [bytearray(16 << 20) for _ in range(40)]\n",  # 640 MB against 128
    "processes": (
        "import os, time\n"
        "for _ in range(100):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
    ),
    "cpu": "while True:\n    pass\n",  # past cpu_seconds: 1
    "cwd": "import os\nos.chdir('/proc')\n",  # a call would start in the template's /proc
    "exits": "import os, time\nos.write(1, b'r')\ntime.sleep(0.4)\nos._exit(0)\n",  # ready, then gone
}


@needs_fork_mode
@pytest.mark.parametrize("bad", sorted(BAD_IMPORTS))
def test_a_template_whose_imports_break_its_limits_or_leave_it_astray_is_refused(
    bench: ToolBench, capfd: pytest.CaptureFixture[str], bad: str
) -> None:
    mark = _marker()
    folder = bench.tool(
        "astray",
        "import json, sys\nimport heavy\nsys.stdin.read()\nprint(json.dumps({'ok': True}))\n",
        env={"FORK_MARK": mark},
        limits={"memory_mb": 128, "max_pids": 32, "cpu_seconds": 1, "timeout_ms": 5000},
    )
    (folder / "heavy.py").write_text(BAD_IMPORTS[bad])
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    said: list[str] = []
    with bench.runner():
        wait_for(lambda: _warned(capfd, said, "astray cannot run in fork mode"), 30.0)
    text = "".join(said)
    assert "internal error" not in text, text  # refused, not a fault of the runner
    why = {"cwd": "outside /tool", "processes": "processes besides the template"}.get(bad)
    assert why is None or why in text, text
    # The imports were held to the tool's limits, and nothing of them is left.
    wait_for(lambda: processes_with_env(f"FORK_MARK={mark}") == [], 10.0)


@needs_fork_mode
def test_a_reload_lets_forked_calls_in_flight_finish_and_then_retires_their_template(
    bench: ToolBench,
) -> None:
    mark = _marker()
    bench.tool("limited", LIMITS, env={"FORK_MARK": mark})
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    with bench.runner() as runner:
        old = _template(runner, "limited", mark)

        async def reload_under_a_call() -> Any:
            call = asyncio.ensure_future(runner.acall("limited", {"what": "nap"}))
            await asyncio.to_thread(wait_for, lambda: len(running_with(mark)) == 2, 10.0)
            runner.reload(tools=[bench.tools], policies=bench.root / "policies.yaml")
            # The next call brings the pools to the new policy: the old template retires.
            assert (await runner.acall("limited", {"what": "fine"})).result == {"what": "fine"}
            assert old in running_with(mark)  # its call still runs
            return await call

        answer = asyncio.run(reload_under_a_call())
        assert answer.success and answer.result == {"what": "nap"}, answer.error
        wait_for(lambda: old not in running_with(mark), 10.0)  # then it is gone
        _ready(runner, "limited")
        assert runner.call("limited", {"what": "fine"}).result == {"what": "fine"}


@needs_fork_mode
def test_a_private_tools_copy_is_readable_by_its_template_alone(bench: ToolBench) -> None:
    from sandboxes.subprocess.sandbox import default_state_dir

    bench.tools.chmod(0o700)  # its folder private: the template gets a copy of it
    bench.tool("limited", LIMITS)
    private = (
        bench.tools / "limited" / f"private-{_marker()}.txt"
    )  # found by it: runners other tests left open have copies too
    private.write_text("root's alone")
    private.chmod(0o600)
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    with bench.runner() as runner:
        _ready(runner, "limited")
        (copied,) = (default_state_dir() / "scratch").glob(f"{os.getpid()}-*/tool/{private.name}")
        copy = copied.parent
        folder = copy.parent.stat()
        assert (stat.S_IMODE(folder.st_mode), folder.st_uid) == (0o750, 0)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(copy / "main.py")]
        assert subprocess.run(nobody, capture_output=True, check=False).returncode != 0  # another local user
        assert stat.S_IMODE(copied.stat().st_mode) == 0o600  # as the original: not the tool's
        assert runner.call("limited", {"what": "fine"}).result == {"what": "fine"}


@needs_fork_mode
def test_a_call_that_signals_its_process_group_reaches_no_other_call_nor_the_template(
    bench: ToolBench,
) -> None:
    """Each call's process is a session and process group of its own: ``kill(0, ...)``
    reaches the calling call alone, not a call beside it, the template, or the next
    call's process, made ahead and held meanwhile (a signal planted there would act in
    whichever call took it next)."""
    mark = _marker()
    bench.tool("limited", LIMITS, env={"FORK_MARK": mark}, limits={"timeout_ms": 10000})
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    with bench.runner() as runner, ThreadPoolExecutor(2) as callers:
        template = _template(runner, "limited", mark)
        killer = callers.submit(runner.call, "limited", {"what": "group", "after": 0.5, "signal": "kill"})
        beside = runner.call("limited", {"what": "nap"})  # runs while the group is killed
        killer.result()
        assert beside.result == {"what": "nap"}, beside.error
        assert running_with(mark) == [template]
        # A spare is made once a call ends: the planter signals its group while one is held.
        planter = callers.submit(runner.call, "limited", {"what": "group", "after": 0.5, "signal": "int"})
        assert runner.call("limited", {"what": "fine"}).result == {"what": "fine"}
        wait_for(lambda: spare_of(processes_with_env(f"FORK_MARK={mark}")) != [], 10.0)
        assert planter.result().result == {"what": "group"}
        after = runner.call("limited", {"what": "fine"})
        assert after.result == {"what": "fine"}, after.error
        assert running_with(mark) == [template]
        assert runner._pools.takes()["limited"] == (5, 0)  # each forked from the one template
