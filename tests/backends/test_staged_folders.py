"""Tool folders the sandbox user cannot reach, bound once in the launch thread's own mount
namespace (``sandboxes.subprocess._staged_folders``), not by the launcher for every call."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ToolBench

from sandboxes.subprocess._command import reachable_by_others
from sandboxes.subprocess._staged_folders import StagedFolders, folder_id

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only a root runner stages tool folders")

LOOKS_AROUND = """
import glob, json, os, sys
params = json.load(sys.stdin)["params"]
tried = {}
for path in [params["other"] + "/secret.txt", *glob.glob("/run/runner/stage/tools/*/secret.txt")]:
    try:
        tried[path] = open(path).read()
    except OSError as exc:
        tried[path] = exc.strerror
print(json.dumps({
    "mine": open("/tool/secret.txt").read(),
    "tried": tried,
    "other_mounted": params["other"] in open("/proc/self/mountinfo").read(),
}))
"""

ANSWERS = """
import json, sys
sys.stdin.read()
print(json.dumps(open("/tool/answer.txt").read()))
"""


def _threads_with_binds_of(*folders: Path) -> list[str]:
    """The runner's threads whose mount namespace has one of ``folders`` bound onto a
    point (each thread's view: ``/proc/self/task/<tid>/mountinfo``), each checked to be
    read-only."""
    roots = {str(folder) for folder in folders}
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            mounts = Path(f"/proc/self/task/{tid}/mountinfo").read_text()
        except OSError:
            continue  # ended meanwhile
        # Fields: id, parent, device, root (the folder bound), mount point, options, ...
        binds = [line.split() for line in mounts.splitlines() if "/stage/tools/" in line]
        binds = [fields for fields in binds if fields[3] in roots]
        if binds:
            assert all(fields[5].split(",")[0] == "ro" for fields in binds), binds
            found.append(tid)
    return found


def test_a_tool_sees_its_own_folder_and_no_other_tools(bench: ToolBench) -> None:
    other = bench.tool("other", LOOKS_AROUND, parameters={"type": "object"})
    (other / "secret.txt").write_text("other's secret")
    mine = bench.tool("mine", LOOKS_AROUND, parameters={"type": "object"})
    (mine / "secret.txt").write_text("my secret")
    assert not reachable_by_others(mine)  # pytest's folders are root's own (0700)
    runner = bench.runner()
    try:
        first = runner.handle({"toolName": "other", "params": {"other": str(mine)}})
        answer = runner.handle({"toolName": "mine", "params": {"other": str(other)}})
        # Both folders are bound now, in one thread of the runner only, read-only; not in
        # the runner's main thread, and not on the host.
        assert len(_threads_with_binds_of(mine, other)) == 1
        assert str(mine) not in Path("/proc/self/mountinfo").read_text()
        assert str(mine) not in Path("/proc/1/mountinfo").read_text()
    finally:
        runner.close()
    for result in (first, answer):
        assert result["success"], result
        assert not result["result"]["other_mounted"]
        assert result["result"]["tried"]  # the other's folder, by its host path
        assert not [text for text in result["result"]["tried"].values() if "secret" in text]
    assert answer["result"]["mine"] == "my secret"
    assert first["result"]["mine"] == "other's secret"
    # Closed: no thread of this process holds the binds any more (the launch thread ended).
    assert _threads_with_binds_of(mine, other) == []


def test_a_tool_folder_replaced_between_calls_is_bound_again(bench: ToolBench) -> None:
    folder = bench.tool("swap", ANSWERS)
    (folder / "answer.txt").write_text("old")
    runner = bench.runner()
    try:
        assert runner.handle({"toolName": "swap", "params": {}})["result"] == "old"
        folder.rename(bench.root / "swap-old")
        shutil.copytree(bench.root / "swap-old", folder)
        (folder / "answer.txt").write_text("new")
        assert runner.handle({"toolName": "swap", "params": {}})["result"] == "new"
    finally:
        runner.close()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A tool folder of the test's own."""
    made = tmp_path / "tool"
    made.mkdir()
    return made


@pytest.fixture
def staged(tmp_path: Path) -> Iterator[StagedFolders]:
    """Launch thread of the test's own, its points in ``tmp_path``, shut down after."""
    folders = StagedFolders(tmp_path / "points")
    yield folders
    folders.shutdown()


def test_a_bind_is_read_only_and_refused_when_the_thread_sees_another_folder(
    folder: Path, staged: StagedFolders
) -> None:
    # The caller's id for the path does not match what the thread's namespace sees.
    assert staged.run(lambda: staged.point(folder, (0, 0))) is None
    point = staged.run(lambda: staged.point(folder, folder_id(folder)))
    assert point is not None
    assert staged.run(lambda: staged.point(folder, folder_id(folder))) == point  # once
    assert not os.path.ismount(point)  # nothing is mounted where the caller looks
    with pytest.raises(OSError) as refused:
        staged.run(lambda: (point / "planted").write_text("x"))
    assert refused.value.errno == errno.EROFS
    assert not (folder / "planted").exists()


def test_a_bind_is_made_on_the_launch_thread_only(
    folder: Path, staged: StagedFolders, tmp_path: Path
) -> None:
    staged.run(lambda: None)  # the thread exists
    with pytest.raises(RuntimeError, match="launch thread"):
        staged.point(folder, folder_id(folder))  # here: the host's namespace
    assert not list((tmp_path / "points").glob("*"))


# Run as a program of its own in a mount namespace whose mounts are shared (as on a
# systemd host; pytest's own may be private, where nothing would propagate anyway).
BINDS_STAY_IN_THE_THREAD = """
import sys
from pathlib import Path
from sandboxes.subprocess._staged_folders import StagedFolders, folder_id
folder, points = Path(sys.argv[1]), Path(sys.argv[2])
staged = StagedFolders(points)
point = staged.run(lambda: staged.point(folder, folder_id(folder)))
seen_by_thread = staged.run(lambda: str(folder) in Path("/proc/thread-self/mountinfo").read_text())
seen_here = str(folder) in Path("/proc/self/mountinfo").read_text()
staged.shutdown()
print(point is not None, seen_by_thread, seen_here)
"""


def test_binds_do_not_propagate_out_of_the_launch_thread_where_mounts_are_shared(
    folder: Path, tmp_path: Path
) -> None:
    unshare = shutil.which("unshare")
    assert unshare is not None
    argv = [
        unshare,
        "--mount",
        "--propagation",
        "shared",
        "--",
        sys.executable,
        "-c",
        BINDS_STAY_IN_THE_THREAD,
    ]
    done = subprocess.run(
        [*argv, str(folder), str(tmp_path / "points")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False"]


def test_a_cancelled_start_still_waits_for_the_thread_to_finish(staged: StagedFolders) -> None:
    finished = threading.Event()

    def slow_start() -> None:
        time.sleep(0.3)
        finished.set()

    async def cancel_twice() -> None:
        started = asyncio.create_task(staged.arun(slow_start))
        await asyncio.sleep(0.05)
        started.cancel()
        await asyncio.sleep(0.05)
        started.cancel()
        with pytest.raises(asyncio.CancelledError):
            await started
        # What the start made is known before the caller goes on to clean up.
        assert finished.is_set()

    asyncio.run(cancel_twice())


def test_a_runner_with_umask_077_and_a_fresh_state_folder_still_runs_staged_tools(
    bench: ToolBench,
) -> None:
    bench.tool("answers", ANSWERS)
    (bench.tools / "answers" / "answer.txt").write_text("ok")
    state = Path("/run") / f"runner-test-umask-{os.getpid()}-{time.monotonic_ns()}"
    bench.policy["sandbox"] = {"backends": {"subprocess": {"state_dir": str(state)}}}
    previous = os.umask(0o077)
    try:
        runner = bench.runner()
        try:
            answer = runner.handle({"toolName": "answers", "params": {}})
        finally:
            runner.close()
    finally:
        os.umask(previous)
        shutil.rmtree(state, ignore_errors=True)
    assert answer["success"], answer
    assert answer["result"] == "ok"
