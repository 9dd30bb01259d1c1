"""The cold path's shortcuts keep what the sandbox promises (issue 13, item 2).

The launcher joins the call's cgroups by moving its own thread (v1 ``tasks``) rather than
its process by pid: these tests look from the host at every thread of every process of a
running tool and require each to sit in the call's own cgroup, in every hierarchy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
from conftest import ToolBench, wait_for

from sandboxes.subprocess._attach import UNKNOWN_STATUS, attach
from sandboxes.subprocess._cgroup import CALLS_DIR, V1_CONTROLLERS, detect_version
from sandboxes.testing import processes_with_env

# A main process with a second thread, and a forked child with one of its own: every
# task of the tool, whichever way it was made, must be in the call's cgroup.
THREADED_FAMILY = """
import os, sys, threading, time
sys.stdin.read()
threading.Thread(target=time.sleep, args=(1.5,), daemon=True).start()
if os.fork() == 0:
    threading.Thread(target=time.sleep, args=(1.5,), daemon=True).start()
    time.sleep(1.5)
    os._exit(0)
time.sleep(1.5)
print('{}')
"""


def _task_cgroups(pid: int) -> list[dict[str, str]]:
    """Per thread of ``pid``: hierarchy (its controllers, or "" for v2) -> cgroup path."""
    tasks = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        lines = (task / "cgroup").read_text().splitlines()
        tasks.append({names: path for _, names, path in (line.split(":", 2) for line in lines)})
    return tasks


def test_every_thread_of_every_tool_process_is_in_the_calls_own_cgroup(bench: ToolBench) -> None:
    bench.tool("family", THREADED_FAMILY)
    runner = bench.runner()
    done: list[dict[str, Any]] = []
    request = {"toolName": "family", "requestId": "req_cgjoin"}
    caller = threading.Thread(target=lambda: done.append(runner.handle(request)))
    caller.start()
    deadline = time.monotonic() + 5
    seen: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        pids = processes_with_env("REQUEST_ID=req_cgjoin")
        seen = [cgroups for pid in pids for cgroups in _task_cgroups(pid)]
        if len(seen) >= 4:  # two processes of the tool, two threads each
            break
        time.sleep(0.05)
    caller.join(10)
    assert done[0]["success"] is True, done[0]
    assert len(seen) >= 4, f"the tool's threads never all showed up: {seen}"
    if detect_version() == 1:
        hierarchies = {name for name in seen[0] if set(V1_CONTROLLERS) & set(name.split(","))}
    else:
        hierarchies = {""}
    assert hierarchies
    for name in hierarchies:
        paths = {task[name] for task in seen}
        assert len(paths) == 1, f"the tool's tasks are in different cgroups of {name!r}: {paths}"
        assert f"/{CALLS_DIR}/" in paths.pop(), f"a task of the tool is outside the call's cgroup ({name!r})"


# Cold calls start the way warm ones do (``Popen``, the exit watched through a pidfd):
# where that is refused, or the exit status cannot be had, no call may pass for a success.
FAILING = "import sys\nsys.stdin.read()\nprint('42')\nsys.exit(3)\n"


@pytest.mark.parametrize("pool", [0, 1])
def test_calls_still_work_where_pidfd_open_is_refused(
    bench: ToolBench, pool: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused)
    bench.tool("answers", "import sys\nsys.stdin.read()\nprint('42')\n")
    bench.tool("fails", FAILING)
    bench.policy["tools"] = {"answers": {"pool": pool}}
    with bench.runner() as runner:
        if pool:
            wait_for(lambda: runner.warm_sandboxes()["answers"] == 1)
        answer = runner.handle({"toolName": "answers", "params": {}})
        failed = runner.handle({"toolName": "fails", "params": {}, "options": {"retries": 0}})
    assert answer["success"] is True and answer["result"] == 42, answer
    assert failed["success"] is False and failed["error"]["details"]["exitCode"] == 3, failed


def test_a_status_the_runner_cannot_get_is_a_failure_not_a_clean_exit() -> None:
    # Reaped by someone else first (as when a process ignores SIGCHLD): Popen.poll would
    # say 0, a success. The runner says 255, as asyncio does.
    async def status() -> int:
        popen = subprocess.Popen(["/bin/sh", "-c", "exit 3"], stdin=PIPE, stdout=PIPE, stderr=PIPE)
        os.waitpid(popen.pid, 0)  # someone else reaps it
        proc = await attach(popen)
        try:
            return await asyncio.wait_for(proc.wait(), 5)
        finally:
            proc.detach()

    assert asyncio.run(status()) == UNKNOWN_STATUS != 0


def test_the_stdin_of_a_tool_that_never_read_it_is_closed_with_its_run() -> None:
    # Closed (not aborted), a pipe with input still unwritten stayed open until that input
    # drained, which never came: past the run and its loop (an unclosed transport).
    async def writers_left() -> int:
        popen = subprocess.Popen(["/bin/sleep", "60"], stdin=PIPE, stdout=PIPE, stderr=PIPE)
        try:
            proc = await attach(popen)
            assert proc.stdin is not None
            proc.stdin.write(b"x" * 2_000_000)  # far more than the pipe holds
            await asyncio.sleep(0.05)
            proc.detach()
            await asyncio.sleep(0.05)
            return _writers_of_stdin(popen.pid)
        finally:
            popen.kill()
            popen.wait()

    assert asyncio.run(writers_left()) == 0


def _writers_of_stdin(pid: int) -> int:
    """How many of our descriptors are the write end of ``pid``'s stdin pipe."""
    pipe = os.readlink(f"/proc/{pid}/fd/0")
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == pipe:
                flags = Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0]
                count += int(flags, 8) & os.O_ACCMODE == os.O_WRONLY
    return count


def test_a_runner_whose_process_ignores_sigchld_refuses_to_run_tools(bench: ToolBench) -> None:
    bench.tool("fails", FAILING)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        with bench.runner() as runner:
            answer = runner.handle({"toolName": "fails", "params": {}, "options": {"retries": 0}})
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert answer["success"] is False, answer
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "ignores SIGCHLD" in answer["error"]["message"]
