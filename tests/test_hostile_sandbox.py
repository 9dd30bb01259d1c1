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

import pytest
from conftest import ToolBench

from sandboxes._identity import UID_BASE, UID_COUNT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="these attacks target a root runner")


def _run(bench: ToolBench, name: str, code: str, **manifest) -> dict:
    bench.tool(name, code, **manifest)
    answer = bench.runner().handle({"toolName": name, "params": {}})
    assert answer["success"] is True, answer
    return answer["result"]


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
    from conftest import processes_with_env

    return processes_with_env(marker)


def test_a_workspace_tool_cannot_leave_a_setuid_file_in_the_host_workspace(bench: ToolBench) -> None:
    workspace = bench.root / "workspace"
    bench.policy["workspace"] = str(workspace)
    report = _run(
        bench,
        "planter",
        """
        import json, os, shutil, sys
        sys.stdin.read()
        ws = os.environ["WORKSPACE"]
        report = {}
        target = os.path.join(ws, "py")
        shutil.copyfile("/usr/bin/python3", target)
        for mode in (0o4755, 0o2755):
            try:
                os.chmod(target, mode)
                report[oct(mode)] = "set"
            except OSError as exc:
                report[oct(mode)] = exc.errno
        try:
            fd = os.open(os.path.join(ws, "made"), os.O_CREAT | os.O_WRONLY, 0o6755)
            os.close(fd)
            report["create"] = "made"
        except OSError as exc:
            report["create"] = exc.errno
        print(json.dumps(report))
        """,
        workspace="write",
    )
    assert report == {"0o4755": 1, "0o2755": 1, "create": 1}
    for path in workspace.iterdir():
        assert not path.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID), path


def test_setid_files_in_a_written_workspace_are_cleared_after_the_call(bench: ToolBench) -> None:
    # Belt and braces behind the filter: whatever set-uid file appears during a call
    # (here the host planted one mid-call, as a racing process could) is cleared at close.
    workspace = bench.root / "workspace"
    workspace.mkdir()
    bench.policy["workspace"] = str(workspace)
    bench.tool(
        "writer",
        """
        import json, os, sys, time
        sys.stdin.read()
        open(os.path.join(os.environ["WORKSPACE"], "note"), "w").write("x")
        time.sleep(0.5)
        print("{}")
        """,
        workspace="write",
    )
    runner = bench.runner()

    async def call_and_plant() -> None:
        call = asyncio.ensure_future(runner.acall("writer", {}))
        while not (workspace / "note").exists():
            await asyncio.sleep(0.02)
        planted = workspace / "planted"
        planted.write_bytes(b"#!/bin/sh\n")
        planted.chmod(0o4755)
        assert (await call).success

    asyncio.run(call_and_plant())
    assert not (workspace / "planted").stat().st_mode & stat.S_ISUID


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


TCP_QUEUE = """
import json, socket, sys
sys.stdin.read()
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(128)
queued, chunk, keep = 0, b"x" * 65536, []
for _ in range(96):
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    keep += [client, peer]
    client.setblocking(False)
    while queued < 400 * 1024 * 1024:
        try:
            queued += client.send(chunk)
        except (BlockingIOError, OSError):
            break
print(json.dumps({"queued_mb": queued // (1024 * 1024)}))
"""


def test_socket_buffers_count_against_the_memory_limit(bench: ToolBench) -> None:
    bench.tool("queue", TCP_QUEUE, limits={"memory_mb": 64, "timeout_ms": 20000})
    answer = bench.runner().handle({"toolName": "queue", "options": {"timeout": 20000}})
    if answer["success"]:
        assert answer["result"]["queued_mb"] < 32, answer["result"]  # a quarter of memory_mb: 16 MB
    else:  # or the attempt is stopped for it
        assert answer["error"]["details"]["reason"] in {"memory_limit", "exit_code", "signal"}


def test_a_degraded_run_still_drops_root_and_says_what_is_missing(bench: ToolBench, monkeypatch) -> None:
    monkeypatch.setenv("RUNNER_BWRAP", "/nonexistent/bwrap")
    bench.policy["sandbox"] = {"allow_degraded": True}
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
    assert any("bubblewrap" in item for item in attempt["missing"])


def test_host_paths_do_not_reach_setup_failures_or_the_sandboxes_proc(bench: ToolBench) -> None:
    folder = bench.tool(
        "cmdline",
        """
        import json, sys
        sys.stdin.read()
        print(json.dumps({"init": open("/proc/1/cmdline", "rb").read().decode(errors="replace")}))
        """,
    )
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


def test_teardown_never_signals_a_pid_that_left_the_cgroup(monkeypatch) -> None:
    # pid reuse: a pid read from cgroup.procs may belong to an unrelated process by the
    # time it is signalled. Here the "member" is a bystander outside the cgroup.
    from sandboxes.subprocess._cgroup import CallCgroup

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        listings = iter([{bystander.pid}])
        monkeypatch.setattr(CallCgroup, "members", lambda self: next(listings, set()))
        CallCgroup(1, []).kill_all()
        assert bystander.poll() is None, "the bystander was killed"
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()
