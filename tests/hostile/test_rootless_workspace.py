"""A rootless runner's workspace write grants are staged, as root's are: the tool writes
into an overlay its launcher mounts in a user namespace, and the runner applies the
writes once the sandbox is gone, never following a symlink, carrying no set-id bit and at
most ``disk_mb`` of them.

Run as a user by ``scripts/test-rootless.sh``; as root the attacks target the root
runner (``test_hostile_sandbox.py``) and these skip.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench
from support.workspace_attacks import SET_ID_MAKER, swap_a_folder_for_a_symlink_during_the_call

from sandboxes import _staging
from sandboxes._staging import UserStagedWorkspace, remove_tree
from sandboxes.subprocess.sandbox import default_state_dir

pytestmark = pytest.mark.skipif(
    os.geteuid() == 0, reason="about a runner that is not root: scripts/test-rootless.sh runs it as a user"
)


def _workspace(bench: ToolBench) -> Path:
    workspace = bench.root / "workspace"
    workspace.mkdir(exist_ok=True)
    bench.policy["workspace"] = str(workspace)
    return workspace


def _call(bench: ToolBench, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = bench.runner().handle({"toolName": name, "params": params or {}})
    return answer


def _stages_left() -> list[str]:
    """Staging folders of this process's runners still on disk."""
    scratch = default_state_dir() / "scratch"
    if not scratch.is_dir():
        return []
    return [p.name for p in scratch.iterdir() if p.name.startswith(f"{os.getpid()}-")]


def test_writes_reach_the_workspace_only_when_the_call_ends_with_deletions_and_replacements(
    bench: ToolBench,
) -> None:
    workspace = _workspace(bench)
    (workspace / "old.txt").write_text("old")
    (workspace / "gone.txt").write_text("gone")
    (workspace / "dir").mkdir()
    (workspace / "dir" / "inner.txt").write_text("inner")
    (workspace / "was_file").write_text("file")
    bench.tool(
        "editor",
        """
        import json, os, shutil, sys, time
        sys.stdin.read()
        ws = os.environ["WORKSPACE"]
        open(os.path.join(ws, "old.txt"), "a").write("+new")
        os.unlink(os.path.join(ws, "gone.txt"))
        shutil.rmtree(os.path.join(ws, "dir"))
        os.mkdir(os.path.join(ws, "dir"))
        open(os.path.join(ws, "dir", "fresh.txt"), "w").write("fresh")
        os.unlink(os.path.join(ws, "was_file"))
        os.makedirs(os.path.join(ws, "was_file", "deep"))
        os.symlink("old.txt", os.path.join(ws, "link"))
        open(os.path.join(ws, "written"), "w").write("x")
        time.sleep(1.5)
        print(json.dumps({"sees": sorted(os.listdir(ws))}))
        """,
        workspace="write",
    )
    runner = bench.runner()

    async def call_and_look() -> tuple[Any, list[str]]:
        call = asyncio.ensure_future(runner.acall("editor", {}))
        deadline = time.monotonic() + 30
        while not _stages_left() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.6)  # the tool has written by now, and sleeps
        during = sorted(p.name for p in workspace.iterdir())
        return await call, during

    answer, during = asyncio.run(call_and_look())
    assert answer.success, answer
    assert answer.result["sees"] == ["dir", "link", "old.txt", "was_file", "written"]
    assert during == ["dir", "gone.txt", "old.txt", "was_file"]  # staged: nothing yet
    assert (workspace / "old.txt").read_text() == "old+new"
    assert not (workspace / "gone.txt").exists()
    assert sorted(p.name for p in (workspace / "dir").iterdir()) == ["fresh.txt"]
    assert (workspace / "was_file" / "deep").is_dir()
    assert os.readlink(workspace / "link") == "old.txt"
    assert _stages_left() == []


def test_a_symlink_the_tool_plants_leads_nowhere_outside_in_this_call_or_the_next(bench: ToolBench) -> None:
    workspace = _workspace(bench)
    victim = bench.root / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    bench.tool(
        "planter",
        """
        import json, os, sys
        params = json.loads(sys.stdin.read())["params"]
        ws = os.environ["WORKSPACE"]
        link = os.path.join(ws, "escape")
        if not os.path.islink(link):
            os.symlink(params["victim"], link)
        report = {}
        for name in ("planted.txt", "keep.txt"):
            try:
                with open(os.path.join(link, name), "w") as f:
                    f.write("tool's")
                report[name] = "written"
            except OSError as exc:
                report[name] = exc.errno
        print(json.dumps(report))
        """,
        workspace="write",
    )
    for _ in range(2):  # the second call finds the symlink in the workspace itself
        answer = _call(bench, "planter", {"victim": str(victim)})
        assert answer["success"] is True, answer["error"]["details"]["stderr"]
        assert answer["result"] == {"planted.txt": 2, "keep.txt": 2}  # ENOENT: not there inside
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "mine"
    assert os.readlink(workspace / "escape") == str(victim)


def test_applying_never_follows_a_symlink_swapped_into_the_workspace_during_the_call(
    bench: ToolBench,
) -> None:
    workspace = _workspace(bench)
    (workspace / "out").mkdir()
    victim = bench.root / "victim"
    victim.mkdir()
    swap_a_folder_for_a_symlink_during_the_call(bench, workspace, victim, sleep_s=1.2)


def test_a_setuid_file_the_tool_makes_reaches_the_workspace_without_its_bits(bench: ToolBench) -> None:
    # The seccomp filter refuses the bits inside; were it to let one through, the apply
    # would still carry none over.
    workspace = _workspace(bench)
    answer = _call_tool(
        bench,
        "setid",
        SET_ID_MAKER,
    )
    assert answer["result"] == {"0o4755": 1, "0o2755": 1, "create": 1}
    assert sorted(p.name for p in workspace.iterdir()) == ["py"]
    assert not (workspace / "py").stat().st_mode & (stat.S_ISUID | stat.S_ISGID)


def test_the_apply_strips_set_id_bits_an_upper_layer_holds(tmp_path: Path) -> None:
    # What the filter keeps a tool from making, planted in the upper layer itself.
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    stage = UserStagedWorkspace(tmp_path / "stage", disk_mb=8)
    stage.create()
    planted = stage.root / "upper" / "su"
    planted.write_bytes(b"#!/bin/sh\n")
    planted.chmod(0o6755)
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        stage.apply(fd)
    finally:
        os.close(fd)
        stage.remove()
    assert stat.S_IMODE((workspace / "su").stat().st_mode) == 0o755
    assert not stage.root.exists()


def test_once_disk_mb_is_spent_the_apply_looks_at_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tool that leaves many thousand empty files must not cost the runner a look at each
    # after its call: past the bound (1024 entries at disk_mb 1) the apply stops.
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    stage = UserStagedWorkspace(tmp_path / "stage", disk_mb=1)
    stage.create()
    for index in range(5000):
        (stage.root / "upper" / f"f{index}").touch()
    looked = 0
    real_stat = os.stat

    def counting_stat(*args: Any, **kwargs: Any) -> os.stat_result:
        nonlocal looked
        looked += 1
        return real_stat(*args, **kwargs)

    monkeypatch.setattr(os, "stat", counting_stat)
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        stage.apply(fd)
    finally:
        os.close(fd)
        monkeypatch.undo()
        stage.remove()
    assert len(list(workspace.iterdir())) == 1024
    assert looked < 1200  # each applied entry, its copy's checks, and the first one refused


def _call_tool(bench: ToolBench, name: str, code: str, **manifest: Any) -> dict[str, Any]:
    bench.tool(name, code, workspace="write", **manifest)
    answer = _call(bench, name)
    assert answer["success"] is True, answer
    return answer


@pytest.mark.parametrize("ending", ["failure", "timeout"])
def test_writes_of_a_call_that_fails_or_times_out_are_applied_as_roots_are(
    bench: ToolBench, ending: str
) -> None:
    # Root applies a call's writes whatever its outcome: so does a runner without root,
    # and only once the tool is gone (the timed-out tool wrote on until killed).
    workspace = _workspace(bench)
    bench.tool(
        "failer",
        """
        import os, sys, time
        params = __import__("json").loads(sys.stdin.read())["params"]
        ws = os.environ["WORKSPACE"]
        open(os.path.join(ws, "before.txt"), "w").write("written")
        if params["ending"] == "failure":
            sys.exit(3)
        while True:
            with open(os.path.join(ws, "ticks.txt"), "a") as f:
                f.write("t")
            time.sleep(0.05)
        """,
        workspace="write",
        limits={"timeout_ms": 2000},
    )
    answer = _call(bench, "failer", {"ending": ending})
    assert answer["success"] is False
    if ending == "timeout":
        assert answer["error"]["code"] == "TIMEOUT", answer
    else:
        assert answer["error"]["details"]["reason"] == "exit_code", answer
    assert (workspace / "before.txt").read_text() == "written"
    if ending == "timeout":
        ticks = (workspace / "ticks.txt").read_text()
        time.sleep(0.5)
        assert (workspace / "ticks.txt").read_text() == ticks  # nothing writes any more
    assert _stages_left() == []


def test_a_read_grant_stays_read_only(bench: ToolBench) -> None:
    workspace = _workspace(bench)
    (workspace / "data.txt").write_text("data")
    bench.tool(
        "reader",
        """
        import json, os, sys
        sys.stdin.read()
        ws = os.environ["WORKSPACE"]
        try:
            open(os.path.join(ws, "new.txt"), "w").write("x")
            wrote = "yes"
        except OSError as exc:
            wrote = exc.errno
        print(json.dumps({"read": open(os.path.join(ws, "data.txt")).read(), "wrote": wrote}))
        """,
        workspace="read",
    )
    answer = _call(bench, "reader")
    assert answer["result"] == {"read": "data", "wrote": 30}  # EROFS
    assert sorted(p.name for p in workspace.iterdir()) == ["data.txt"]


def test_a_workspace_far_larger_than_disk_mb_is_not_copied_and_stays_intact(bench: ToolBench) -> None:
    workspace = _workspace(bench)
    block = os.urandom(1024 * 1024)
    with (workspace / "big.bin").open("wb") as f:
        for _ in range(128):
            f.write(block)
    answer = _call_tool(
        bench,
        "bigreader",
        """
        import hashlib, json, os, sys
        sys.stdin.read()
        ws = os.environ["WORKSPACE"]
        digest = hashlib.sha256()
        with open(os.path.join(ws, "big.bin"), "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        open(os.path.join(ws, "summary.txt"), "w").write(digest.hexdigest())
        print(json.dumps({"sha": digest.hexdigest()}))
        """,
        limits={"disk_mb": 8},
    )
    assert (workspace / "summary.txt").read_text() == answer["result"]["sha"]
    assert (workspace / "big.bin").stat().st_size == 128 * 1024 * 1024
    assert _stages_left() == []


def test_at_most_disk_mb_of_writes_is_applied_in_bytes_and_in_entries(bench: ToolBench) -> None:
    workspace = _workspace(bench)
    answer = _call_tool(
        bench,
        "flooder",
        """
        import json, os, sys
        sys.stdin.read()
        ws = os.environ["WORKSPACE"]
        report = {"big": 0, "empty": 0}
        for i in range(4):  # each file within the file-size rlimit, together past disk_mb
            with open(os.path.join(ws, "big%d" % i), "wb") as f:
                f.write(b"x" * (6 * 1024 * 1024))
            report["big"] += 1
        for i in range(3000):
            open(os.path.join(ws, "e%05d" % i), "w").close()
            report["empty"] += 1
        print(json.dumps(report))
        """,
        limits={"disk_mb": 8},
    )
    assert answer["result"] == {"big": 4, "empty": 3000}
    applied = list(workspace.iterdir())
    assert sum(p.stat().st_size for p in applied) <= 8 * 1024 * 1024
    assert len(applied) <= 8 * 256
    assert _stages_left() == []


def _alive_with(token: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_killed_runner_leaves_no_tool_and_no_staging_folder_a_second_later(bench: ToolBench) -> None:
    workspace = _workspace(bench)
    marker = f"stager-{os.getpid()}-{time.monotonic_ns()}"
    bench.tool(
        "stager",
        """
        import os, sys, time
        sys.stdin.read()
        open(os.path.join(os.environ["WORKSPACE"], "partial.txt"), "w").write("x")
        time.sleep(60)
        """,
        workspace="write",
        command=["python3", "main.py", marker],
    )
    proc = bench.spawn_runner("stager", "req_killed_stager")
    scratch = default_state_dir() / "scratch"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stages = list(scratch.glob(f"{proc.pid}-*/upper/partial.txt")) if scratch.is_dir() else []
            if stages and _alive_with(marker.encode()):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the tool never wrote into its staged workspace")
    finally:
        proc.kill()
        proc.wait()
    time.sleep(1.0)
    assert _alive_with(marker.encode()) == []
    deadline = time.monotonic() + 5  # the watchdog's sweep of the folder follows the kill
    while list(scratch.glob(f"{proc.pid}-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(scratch.glob(f"{proc.pid}-*")) == []
    assert list(workspace.iterdir()) == []  # a call that never ended applies nothing


def test_a_kernel_refusing_the_overlay_fails_the_call_closed_never_binding_directly(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An overlay option this kernel does not know stands for one without user-namespace
    # overlays: the call is sandbox_unavailable, the tool never runs, nothing is written.
    from sandboxes.subprocess import _launch

    monkeypatch.setattr(
        _launch, "USER_OVERLAY_SCRIPT", _launch.USER_OVERLAY_SCRIPT.replace("userxattr", "nosuch")
    )
    workspace = _workspace(bench)
    bench.tool(
        "writer",
        """
        import os, sys
        sys.stdin.read()
        open(os.path.join(os.environ["WORKSPACE"], "direct.txt"), "w").write("x")
        print("{}")
        """,
        workspace="write",
    )
    answer = _call(bench, "writer")
    assert answer["success"] is False
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable", answer["error"]
    assert "cannot stage the workspace" in answer["error"]["message"]
    assert list(workspace.iterdir()) == []
    assert _stages_left() == []


# What a build tool's cache does (Go's module cache): read-only folders with their files,
# and, here, a locked folder and a file nobody may read.
LOCKER = """
import os, sys
sys.stdin.read()
ws = os.environ["WORKSPACE"]
os.makedirs(os.path.join(ws, "aaa", "sub"))
open(os.path.join(ws, "aaa", "sub", "f"), "w").write("f")
os.chmod(os.path.join(ws, "aaa", "sub"), 0o555)
os.chmod(os.path.join(ws, "aaa"), 0o555)
os.makedirs(os.path.join(ws, "locked"))
open(os.path.join(ws, "locked", "big"), "wb").write(b"x" * (5 * 1024 * 1024))
os.chmod(os.path.join(ws, "locked"), 0)
open(os.path.join(ws, "unreadable"), "w").write("u")
os.chmod(os.path.join(ws, "unreadable"), 0)
open(os.path.join(ws, "zzz"), "w").write("z")
print("{}")
"""
# Then, as ``go clean -modcache``: a read-only folder opened, written and closed again,
# and read-only trees opened up and removed.
CLEANER = """
import os, shutil, sys
sys.stdin.read()
ws = os.environ["WORKSPACE"]
aaa = os.path.join(ws, "aaa")
os.chmod(aaa, 0o755)
open(os.path.join(aaa, "new"), "w").write("new")
os.chmod(os.path.join(aaa, "sub"), 0o755)
shutil.rmtree(os.path.join(aaa, "sub"))
os.chmod(aaa, 0o555)
os.chmod(os.path.join(ws, "locked"), 0o700)
shutil.rmtree(os.path.join(ws, "locked"))
print("{}")
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_read_only_and_locked_folders_and_files_are_applied_with_their_modes_and_removed(
    bench: ToolBench,
) -> None:
    workspace = _workspace(bench)
    try:
        _call_tool(bench, "locker", LOCKER)
        assert _stages_left() == []
        assert sorted(p.name for p in workspace.iterdir()) == ["aaa", "locked", "unreadable", "zzz"]
        assert (_mode(workspace / "aaa"), _mode(workspace / "aaa" / "sub")) == (0o555, 0o555)
        assert (workspace / "aaa" / "sub" / "f").read_text() == "f"
        assert (_mode(workspace / "locked"), _mode(workspace / "unreadable")) == (0, 0)
        (workspace / "locked").chmod(0o700)
        assert (workspace / "locked" / "big").stat().st_size == 5 * 1024 * 1024
        (workspace / "locked").chmod(0)
        assert (workspace / "zzz").read_text() == "z"

        _call_tool(bench, "cleaner", CLEANER)
        assert _stages_left() == []
        assert sorted(p.name for p in workspace.iterdir()) == ["aaa", "unreadable", "zzz"]
        assert sorted(p.name for p in (workspace / "aaa").iterdir()) == ["new"]
        assert _mode(workspace / "aaa") == 0o555
    finally:
        for folder in (workspace, *workspace.rglob("*")):
            if not folder.is_symlink():
                folder.chmod(0o700)


def test_a_leftover_upper_layer_of_locked_folders_is_removed_whole_following_no_symlink(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    outside.chmod(0o500)
    root = tmp_path / "stage"
    deep = root / "upper" / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "f").write_text("f")
    (deep / "f").chmod(0)
    (root / "upper" / "link").symlink_to(outside)
    (root / "work" / "work" / "inner").mkdir(parents=True)
    for folder, mode in ((deep, 0o555), (root / "upper" / "a", 0), (root / "work" / "work", 0)):
        folder.chmod(mode)
    try:
        remove_tree(root)
        assert not root.exists()
        assert _mode(outside) == 0o500
        assert (outside / "keep").read_text() == "keep"
    finally:
        outside.chmod(0o700)
        for folder in (root, *root.rglob("*")) if root.exists() else ():
            if not folder.is_symlink():
                folder.chmod(0o700)


def test_leftover_folders_of_an_earlier_runner_of_this_pid_neither_fail_calls_nor_are_removed(
    bench: ToolBench,
) -> None:
    # A runner with this pid once died leaving its folders (its pid is alive again: ours,
    # so no sweep takes them): a fresh name is chosen; what is there is not ours to remove.
    workspace = _workspace(bench)
    scratch = default_state_dir() / "scratch"
    scratch.mkdir(mode=0o711, parents=True, exist_ok=True)
    leftovers = [scratch / f"{os.getpid()}-{n}" for n in range(1, 400)]
    for folder in leftovers:
        folder.mkdir(exist_ok=True)
        (folder / "mark").write_text("not yours")
    try:
        _call_tool(bench, "writer", WRITER)
        _call_tool(bench, "writer", WRITER)
        assert (workspace / "written").read_text() == "x"
        assert all((folder / "mark").read_text() == "not yours" for folder in leftovers)
    finally:
        for folder in leftovers:
            shutil.rmtree(folder, ignore_errors=True)
    assert _stages_left() == []


WRITER = """
import os, sys
sys.stdin.read()
open(os.path.join(os.environ["WORKSPACE"], "written"), "w").write("x")
print("{}")
"""


def test_an_apply_that_fails_is_a_clear_call_error_and_leaves_no_staging_folder(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_staging, "_copy_file", full)
    _workspace(bench)
    bench.tool("writer", WRITER, workspace="write")
    answer = _call(bench, "writer")
    assert answer["success"] is False
    error = answer["error"]
    assert (error["code"], error["details"]["reason"]) == ("EXECUTION_ERROR", "workspace_not_applied"), error
    assert "No space left on device" in error["message"]
    assert _stages_left() == []


def test_a_workspace_path_that_leads_elsewhere_by_launch_fails_the_call_closed(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writes are applied to the folder opened when the call was prepared; were the
    # launcher to bind whatever the path leads to by then, the tool would read another.
    from sandboxes._workspace import GrantedWorkspace

    workspace = _workspace(bench)
    (workspace / "a_only").write_text("a")
    moved = bench.root / "moved"
    opened = GrantedWorkspace.open

    def open_then_move(*args: Any, **kwargs: Any) -> GrantedWorkspace | None:
        granted = opened(*args, **kwargs)
        workspace.rename(moved)
        workspace.mkdir()
        (workspace / "b_only").write_text("b")
        return granted

    monkeypatch.setattr(GrantedWorkspace, "open", open_then_move)
    bench.tool(
        "looker",
        """
        import json, os, sys
        sys.stdin.read()
        ws = os.environ["WORKSPACE"]
        seen = sorted(os.listdir(ws))
        open(os.path.join(ws, "written"), "w").write("x")
        print(json.dumps({"seen": seen}))
        """,
        workspace="write",
    )
    answer = _call(bench, "looker")
    assert answer["success"] is False, answer
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable", answer["error"]
    assert "another folder" in answer["error"]["message"]
    assert sorted(p.name for p in moved.iterdir()) == ["a_only"]
    assert sorted(p.name for p in workspace.iterdir()) == ["b_only"]
    assert _stages_left() == []
