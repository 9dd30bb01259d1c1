"""The cold path's shortcuts keep what the sandbox promises (issue 13, item 2).

The launcher joins the call's cgroups by moving its own thread (v1 ``tasks``) rather than
its process by pid: these tests look from the host at every thread of every process of a
running tool and require each to sit in the call's own cgroup, in every hierarchy.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from conftest import ToolBench

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
