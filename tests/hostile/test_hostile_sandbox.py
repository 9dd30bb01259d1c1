"""Attacks from the hostile review of the subprocess sandbox, each a real tool.

Every test here failed on the commit before its fix (see the README's guarantees).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench
from docker import APIClient
from support.socket_hoard import (
    SOCKET_HOARDER,
    UNACCEPTED_HOARDER,
    assert_sockets_held,
    assert_unaccepted_held,
)
from support.workspace_attacks import SET_ID_MAKER, swap_a_folder_for_a_symlink_during_the_call

from sandboxes._identity import UID_BASE, UID_COUNT
from sandboxes._socket_memory import sockets_overran

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="these attacks target a root runner")


def _run(bench: ToolBench, name: str, code: str, **manifest: Any) -> dict[str, Any]:
    bench.tool(name, code, **manifest)
    answer = bench.runner().handle({"toolName": name, "params": {}})
    assert answer["success"] is True, answer
    result: dict[str, Any] = answer["result"]
    return result


SYSCALLS = """
import ctypes, json, os, sys
sys.stdin.read()
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    result = libc.syscall(number, *args)
    return 0 if result >= 0 else ctypes.get_errno()
report = {
    "ptrace_seize_init": call(101, 0x4206, 1, 0, 0),
    "add_key": call(248, b"user", b"runner-test", b"secret", 6, ctypes.c_int(-2)),
    "keyctl_get_keyring": call(250, 0, ctypes.c_int(-2), 0),
    "io_uring_setup": call(425, 4, ctypes.create_string_buffer(120)),
    "bpf": call(321, 0, 0, 0),
    "perf_event_open": call(298, ctypes.create_string_buffer(128), 0, -1, -1, 0),
    "userfaultfd": call(323, 0),
    "pidfd_getfd": call(438, -1, 0, 0),  # EBADF unfiltered: another process's descriptors
}
print(json.dumps(report))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers are x86_64's")
def test_the_seccomp_filter_refuses_ptrace_keys_io_uring_bpf_perf_and_userfaultfd(bench: ToolBench) -> None:
    report = _run(bench, "syscalls", SYSCALLS)
    assert report == dict.fromkeys(report, 1)  # EPERM, every one


def test_concurrent_sandboxes_run_as_distinct_host_uids_from_the_runners_range(bench: ToolBench) -> None:
    bench.tool(
        "whoami",
        """
        import json, os, sys, time
        sys.stdin.read()
        status = open("/proc/self/status").read()
        time.sleep(0.8)  # overlap with the others
        print(json.dumps({"inside": os.getuid(), "status": status}))
        """,
    )
    # Cold: found by REQUEST_ID; a fork-mode tool's calls share its template's uid (docs/security.md).
    bench.policy["tools"] = {"whoami": {"pool": 0}}
    runner = bench.runner()
    seen: list[tuple[int, int]] = []

    async def one(i: int) -> None:
        call = asyncio.ensure_future(runner.acall("whoami", {}, request_id=f"req_uid_{i}"))
        while not call.done():
            for pid in _pids_with_env(f"REQUEST_ID=req_uid_{i}"):
                try:
                    uid = int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
                except (OSError, IndexError):
                    continue
                seen.append((i, uid))
                break
            await asyncio.sleep(0.05)
        assert (await call).success

    async def together() -> None:
        await asyncio.gather(*(one(i) for i in range(4)))

    asyncio.run(together())
    by_call = dict(seen)
    assert len(by_call) == 4, seen
    assert len(set(by_call.values())) == 4  # no two concurrent sandboxes share a uid
    assert all(UID_BASE <= uid < UID_BASE + UID_COUNT for uid in by_call.values())


def _pids_with_env(marker: str) -> list[int]:
    from sandboxes.testing import processes_with_env

    return processes_with_env(marker)


def test_a_workspace_tool_cannot_leave_a_setuid_file_in_the_host_workspace(bench: ToolBench) -> None:
    workspace = bench.root / "workspace"
    bench.policy["workspace"] = str(workspace)
    report = _run(
        bench,
        "planter",
        SET_ID_MAKER,
        workspace="write",
    )
    assert report == {"0o4755": 1, "0o2755": 1, "create": 1}
    for path in workspace.iterdir():
        assert not path.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID), path


@pytest.mark.docker
def test_a_setuid_file_made_in_a_docker_workspace_reaches_the_host_without_its_bit(
    bench: ToolBench, docker_client: APIClient
) -> None:
    # Docker's own seccomp profile lets a tool chmod u+s; the workspace still gets none.
    workspace = bench.root / "workspace"
    bench.policy["workspace"] = str(workspace)
    report = _run(
        bench,
        "dplanter",
        """
        import json, os, shutil, sys
        sys.stdin.read()
        target = os.path.join(os.environ["WORKSPACE"], "py")
        shutil.copyfile("/usr/bin/python3", target)
        os.chmod(target, 0o6755)
        print(json.dumps({"mode": os.stat(target).st_mode & 0o7777}))
        """,
        workspace="write",
        sandbox="docker",
        image="runner/base:latest",
    )
    assert report["mode"] == 0o6755  # the tool did set it, inside
    assert (workspace / "py").exists()
    assert not (workspace / "py").stat().st_mode & (stat.S_ISUID | stat.S_ISGID)


WORKSPACE_FLOOD = """
import json, os, sys
sys.stdin.read()
written = 0
try:
    with open(os.path.join(os.environ["WORKSPACE"], "flood"), "wb") as f:
        while written < 200 * 1024 * 1024:
            f.write(b"x" * 1024 * 1024)
            f.flush()
            written += 1024 * 1024
except OSError as exc:
    print(json.dumps({"written_mb": written // (1024 * 1024), "errno": exc.errno}))
else:
    print(json.dumps({"written_mb": written // (1024 * 1024), "errno": 0}))
"""


@pytest.mark.parametrize("backend", ["subprocess", pytest.param("docker", marks=pytest.mark.docker)])
def test_workspace_writes_stop_at_disk_mb(
    bench: ToolBench, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "docker":
        request.getfixturevalue("docker_client")
    workspace = bench.root / "workspace"
    bench.policy["workspace"] = str(workspace)
    extra = {"sandbox": "docker", "image": "runner/base:latest"} if backend == "docker" else {}
    report = _run(
        bench, "flood", WORKSPACE_FLOOD, workspace="write", limits={"disk_mb": 32, "memory_mb": 256}, **extra
    )
    assert report["errno"] == 28  # ENOSPC
    assert report["written_mb"] <= 32
    assert (workspace / "flood").stat().st_size <= 32 * 1024 * 1024


def test_staged_writes_reach_the_workspace_with_deletions_and_replacements(bench: ToolBench) -> None:
    workspace = bench.root / "workspace"
    workspace.mkdir()
    (workspace / "old.txt").write_text("old")
    (workspace / "gone.txt").write_text("gone")
    (workspace / "dir").mkdir()
    (workspace / "dir" / "inner.txt").write_text("inner")
    (workspace / "was_file").write_text("file")
    for path in workspace.rglob("*"):  # the sandboxes' own to change (they have other uids)
        path.chmod(0o777 if path.is_dir() else 0o666)
    bench.policy["workspace"] = str(workspace)
    _run(
        bench,
        "editor",
        """
        import json, os, shutil, sys
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
        print("{}")
        """,
        workspace="write",
    )
    assert (workspace / "old.txt").read_text() == "old+new"
    assert not (workspace / "gone.txt").exists()
    assert sorted(p.name for p in (workspace / "dir").iterdir()) == ["fresh.txt"]
    assert (workspace / "was_file" / "deep").is_dir()
    assert os.readlink(workspace / "link") == "old.txt"


def test_applying_writes_never_follows_a_symlink_planted_during_the_call(bench: ToolBench) -> None:
    # A local user (or another sandbox) swaps a folder of the workspace for a symlink to a
    # folder of root's while the call runs; the apply must write into neither.
    workspace = bench.root / "workspace"
    workspace.mkdir()
    (workspace / "out").mkdir()
    (workspace / "out").chmod(0o777)
    victim = bench.root / "victim"
    victim.mkdir(mode=0o700)
    bench.policy["workspace"] = str(workspace)
    swap_a_folder_for_a_symlink_during_the_call(bench, workspace, victim, sleep_s=0.8)


def test_a_symlinked_workspace_is_refused_and_its_target_left_untouched(bench: ToolBench) -> None:
    decoy = bench.root / "decoy"
    decoy.mkdir(mode=0o700)
    (bench.root / "ws").symlink_to(decoy)
    bench.policy["workspace"] = str(bench.root / "ws")
    bench.tool("writer", "import sys\nsys.stdin.read()\nprint('{}')\n", workspace="write")
    before = decoy.stat()
    answer = bench.runner().handle({"toolName": "writer"})
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    after = decoy.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)


def test_a_workspace_under_a_folder_another_user_controls_is_refused(bench: ToolBench) -> None:
    theirs = bench.root / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    (theirs / "ws").mkdir()
    bench.policy["workspace"] = str(theirs / "ws")
    bench.tool("reader", "import sys\nsys.stdin.read()\nprint('{}')\n", workspace="read")
    answer = bench.runner().handle({"toolName": "reader"})
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"


def test_thousands_of_loopback_connections_cannot_pin_more_than_the_memory_limit(bench: ToolBench) -> None:
    # 4,000 connections, each holding the minimum the kernel lets a socket keep past the
    # cgroup's TCP limit: 340 MB queued at memory_mb 256 before they were stopped.
    bench.tool("hoarder", SOCKET_HOARDER, limits={"memory_mb": 256, "timeout_ms": 30000})
    answer = bench.runner().handle({"toolName": "hoarder", "options": {"timeout": 30000, "retries": 0}})
    assert_sockets_held(answer, 256)


def test_connections_nobody_accepts_cannot_pin_more_than_the_memory_limit(bench: ToolBench) -> None:
    # Charged to no cgroup: 100 such connections held 439 MB at memory_mb 256 before.
    command = ["python3", "main.py", str(256 * 1024 * 1024)]
    bench.tool(
        "unaccepted", UNACCEPTED_HOARDER, limits={"memory_mb": 128, "timeout_ms": 30000}, command=command
    )
    answer = bench.runner().handle({"toolName": "unaccepted", "options": {"timeout": 30000, "retries": 0}})
    assert_unaccepted_held(answer, 128)


def test_a_degraded_run_still_drops_root_and_says_what_is_missing(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNNER_BWRAP", "/nonexistent/bwrap")
    bench.policy["sandbox"] = {"backends": {"subprocess": {"allow_degraded": True}}}
    bench.tool(
        "shadow",
        """
        import json, os, sys
        sys.stdin.read()
        try:
            open("/etc/shadow").read()
            shadow = "read"
        except OSError as exc:
            shadow = exc.errno
        print(json.dumps({"euid": os.geteuid(), "shadow": shadow}))
        """,
    )
    answer = bench.runner().handle({"toolName": "shadow"})
    assert answer["success"] is True, answer
    assert answer["metadata"]["degraded"] is True
    assert answer["result"]["euid"] != 0
    assert answer["result"]["shadow"] == 13  # EACCES
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    attempt = next(e for e in events if e["event"] == "call.attempt")
    # What the missing layer takes away, not only its name.
    assert any("bubblewrap" in item and "no namespaces" in item for item in attempt["missing"])


def test_host_paths_do_not_reach_setup_failures_or_the_sandboxes_proc(bench: ToolBench) -> None:
    folder = bench.tool(
        "cmdline",
        """
        import json, sys
        sys.stdin.read()
        print(json.dumps({"init": open("/proc/1/cmdline", "rb").read().decode(errors="replace")}))
        """,
    )
    bench.policy["tools"] = {"cmdline": {"pool": 0}}  # its second call must start cold
    runner = bench.runner()
    answer = runner.handle({"toolName": "cmdline"})
    assert answer["success"] is True, answer
    init = answer["result"]["init"]
    assert str(bench.root) not in init
    assert "/run/runner" not in init
    # A setup failure: the tool's folder vanished after the registry was loaded.
    (folder / "main.py").unlink()
    (folder / "tool.yaml").unlink()
    folder.rmdir()
    failed = runner.handle({"toolName": "cmdline"})
    assert failed["error"]["details"]["reason"] == "sandbox_unavailable"
    text = json.dumps(failed)
    assert str(bench.root) not in text
    assert "/run/runner" not in text


def test_teardown_never_signals_a_pid_that_left_the_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    # pid reuse: a pid read from cgroup.procs may belong to an unrelated process by the
    # time it is signalled. Here the "member" is a bystander outside the cgroup.
    from sandboxes.subprocess._cgroup import CallCgroup

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        listings = iter([{bystander.pid}])
        monkeypatch.setattr(CallCgroup, "members", lambda self, everywhere=True: next(listings, set()))
        CallCgroup(1, []).kill_all()
        assert bystander.poll() is None, "the bystander was killed"
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="the hardened sandbox runs as root here")
def test_a_finished_call_never_signals_its_launchers_group_by_a_number_that_may_be_reused(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pid reuse: once the launcher is reaped, its group's number may lead another group
    # (another call's launcher) by the time the call is closed.
    bench.tool("ok", "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n")
    runner = bench.runner()
    signalled: list[int] = []
    real_killpg = os.killpg

    def killpg(pgid: int, sig: int) -> None:
        signalled.append(pgid)
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", killpg)
    try:
        for i in range(3):
            assert runner.handle({"toolName": "ok", "params": {"i": i}})["result"] == {"i": i}
    finally:
        runner.close()
    assert signalled == []


def test_a_forged_user_opaque_attribute_cannot_make_the_apply_delete_roots_files(bench: ToolBench) -> None:
    workspace = bench.root / "workspace"
    (workspace / "d" / "protected").mkdir(parents=True)
    (workspace / "d").chmod(0o777)
    (workspace / "d" / "protected" / "secret.txt").write_text("root's")
    bench.policy["workspace"] = str(workspace)
    report = _run(
        bench,
        "opaquer",
        """
        import json, os, sys
        sys.stdin.read()
        folder = os.path.join(os.environ["WORKSPACE"], "d")
        try:
            os.setxattr(folder, "user.overlay.opaque", b"y")
            forged = True
        except OSError:
            forged = False
        print(json.dumps({"forged": forged}))
        """,
        workspace="write",
    )
    assert report["forged"] in (True, False)
    assert (workspace / "d" / "protected" / "secret.txt").read_text() == "root's"


def test_empty_files_count_against_disk_mb_too(bench: ToolBench) -> None:
    workspace = bench.root / "workspace"
    bench.policy["workspace"] = str(workspace)
    report = _run(
        bench,
        "inodes",
        """
        import json, os, sys
        sys.stdin.read()
        made = 0
        try:
            for i in range(20000):
                open(os.path.join(os.environ["WORKSPACE"], "f%06d" % i), "w").close()
                made += 1
        except OSError as exc:
            print(json.dumps({"made": made, "errno": exc.errno}))
        else:
            print(json.dumps({"made": made, "errno": 0}))
        """,
        workspace="write",
        limits={"disk_mb": 1},
    )
    assert report["errno"] == 28  # ENOSPC: out of inodes
    assert len(list(workspace.iterdir())) <= 1024


def test_a_deep_tree_is_applied_to_a_bounded_depth_and_the_call_still_ends_cleanly(bench: ToolBench) -> None:
    workspace = bench.root / "workspace"
    bench.policy["workspace"] = str(workspace)
    code = """
        import os, sys
        sys.stdin.read()
        os.chdir(os.environ["WORKSPACE"])
        for _ in range(200):
            os.makedirs("a", exist_ok=True)
            os.chdir("a")
        print("{}")
        """
    bench.tool("deep", code, workspace="write")
    runner = bench.runner()
    for _ in range(2):  # and again: nothing (a uid lease, a cgroup) was left held
        assert runner.call("deep", {}).success
    depth, folder = 0, workspace
    while (folder / "a").is_dir():
        folder, depth = folder / "a", depth + 1
    assert 1 <= depth <= 65


TCP_PEAK, TCP_LIMIT = "memory.kmem.tcp.max_usage_in_bytes", "memory.kmem.tcp.limit_in_bytes"


@pytest.mark.parametrize(
    ("version", "files", "overran"),
    [
        (1, {TCP_PEAK: "67117056", TCP_LIMIT: "67108864"}, True),
        (1, {TCP_PEAK: "67108864", TCP_LIMIT: "67108864"}, False),
        (1, {TCP_PEAK: "67117056"}, False),  # the cgroup is gone
        (2, {"memory.peak": "268439552", "memory.max": "268435456"}, True),
        (2, {"memory.peak": "268435456", "memory.max": "268435456"}, False),
        (2, {"memory.peak": "268439552", "memory.max": "max"}, False),
    ],
)
def test_socket_memory_overruns_are_read_from_the_peak_over_the_limit(
    tmp_path: Path, version: int, files: dict[str, str], overran: bool
) -> None:
    # What the kernel shows for a cgroup whose sockets were charged past the limit: the
    # forced charges move the peak only (cgroup v2 is not on the machines the tests run on).
    for name, value in files.items():
        (tmp_path / name).write_text(value + "\n")
    assert sockets_overran(version, tmp_path) is overran
