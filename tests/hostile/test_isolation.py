"""Hostile tools against the hardened sandbox: each attack must fail.

Attacks on the filesystem, network and process view are also run on a plain
subprocess (the degraded mode with no bubblewrap), marked ``xfail(strict=True)``: there
they must succeed, which shows each test is able to fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, starter_dir

from runner.call.answers import CallResult
from sandboxes._identity import UID_BASE, UID_COUNT
from sandboxes.testing import processes_with_env

ATTACK = """
import json, os, sys
params = json.load(sys.stdin)["params"]
result = {}
exec(params["code"], {"params": params, "result": result, "os": os})
json.dump(result, sys.stdout)
"""

PLAIN = pytest.param(
    "plain", marks=pytest.mark.xfail(strict=True, reason="a plain subprocess is not isolated")
)


@pytest.fixture(params=["hardened", PLAIN])
def mode(request: pytest.FixtureRequest, bench: ToolBench, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "plain":
        monkeypatch.setenv("RUNNER_BWRAP", "/nonexistent/bwrap")
        bench.policy["sandbox"] = {"backends": {"subprocess": {"allow_degraded": True}}}
    name: str = request.param
    return name


def attack(bench: ToolBench, code: str, **params: object) -> dict[str, Any]:
    bench.tool("attack", ATTACK, limits={"disk_mb": 8})
    answer = bench.runner().handle(
        {"toolName": "attack", "params": {"code": textwrap.dedent(code), **params}, "options": {"retries": 0}}
    )
    assert answer["success"], answer["error"]
    result: dict[str, Any] = answer["result"]
    return result


def test_the_host_loopback_is_unreachable(bench: ToolBench, mode: str) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted: list[object] = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True)
    thread.start()
    result = attack(
        bench,
        """
        import socket
        try:
            socket.create_connection(("127.0.0.1", params["port"]), timeout=2).close()
            result["connected"] = True
        except OSError as exc:
            result["connected"] = False
            result["error"] = type(exc).__name__
    """,
        port=port,
    )
    thread.join(5)
    server.close()
    assert result["connected"] is False
    assert accepted == [None]


def _accept(server: socket.socket) -> object:
    try:
        conn, _ = server.accept()
        conn.close()
        return "connection"
    except OSError:
        return None


@pytest.fixture
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    tmp_secret = Path("/tmp") / f"runner-secret-{os.getpid()}.txt"
    home = Path.home() / f".runner-secret-{os.getpid()}.txt"
    paths = [tmp_secret, home]
    for path in paths:
        path.write_text("TOP-SECRET")
        path.chmod(0o644)
    yield [*paths, starter_dir() / "policies.yaml", Path("/etc/shadow")]
    for path in paths:
        path.unlink(missing_ok=True)


def test_host_secrets_and_the_policy_file_are_unreadable(
    bench: ToolBench, mode: str, secrets: list[Path]
) -> None:
    policy_copy = bench.root / "policies.yaml"
    result = attack(
        bench,
        """
        for path in params["paths"]:
            try:
                with open(path) as f:
                    result[path] = f.read(100)
            except OSError as exc:
                result[path] = type(exc).__name__
    """,
        paths=[*map(str, secrets), str(policy_copy), str(bench.audit_log)],
    )
    for path, value in result.items():
        assert value in {"FileNotFoundError", "PermissionError"}, (path, value)


def test_the_tool_cannot_write_into_its_own_folder(bench: ToolBench, mode: str) -> None:
    # World-writable, so that only the read-only mount stands in the way (a degraded run
    # drops root too, which alone would stop the write into a root-owned folder).
    (bench.tools / "attack").mkdir()
    (bench.tools / "attack").chmod(0o777)
    result = attack(
        bench,
        """
        try:
            open("planted.py", "w").write("evil")
            result["wrote"] = True
        except OSError as exc:
            result["wrote"] = type(exc).__name__
    """,
    )
    assert result["wrote"] in {"OSError", "PermissionError"}  # EROFS or EACCES
    assert not (bench.tools / "attack" / "planted.py").exists()


def test_filling_the_scratch_space_stops_at_disk_mb(bench: ToolBench, mode: str) -> None:
    result = attack(
        bench,
        """
        written = 0
        block = b"x" * (1024 * 1024)
        try:
            with open(os.path.join(os.environ["TMPDIR"], "fill"), "wb") as f:
                while written < 32 * 1024 * 1024:
                    f.write(block)
                    f.flush()
                    written += len(block)
            result["error"] = None
        except OSError as exc:
            result["error"] = exc.errno
        result["written_mb"] = written // (1024 * 1024)
    """,
    )
    # Rootless without a cgroup the file-size rlimit (disk_mb, for the workspace) is met
    # at the same point: EFBIG.
    rootless = os.geteuid() != 0 and mode == "hardened"
    assert result["error"] in ({27, 28} if rootless else {28})  # EFBIG, ENOSPC
    assert result["written_mb"] <= 8


def test_the_tool_sees_only_its_own_processes(bench: ToolBench, mode: str) -> None:
    result = attack(
        bench,
        """
        result["pids"] = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        result["runner_visible"] = os.path.exists(f"/proc/{params['runner']}")
    """,
        runner=os.getpid(),
    )
    assert len(result["pids"]) <= 5
    assert result["runner_visible"] is False


def test_the_tool_cannot_signal_or_ptrace_the_runner(bench: ToolBench, mode: str) -> None:
    victim = subprocess.Popen(["sleep", "30"])
    result = attack(
        bench,
        """
        import ctypes, signal
        try:
            os.kill(params["runner"], 0)  # 0: probe only; never harm the test process
            result["signal"] = "reachable"
        except OSError as exc:
            result["signal"] = type(exc).__name__
        libc = ctypes.CDLL(None, use_errno=True)
        PTRACE_ATTACH = 16
        # A host process standing in for the runner: attaching to the test process
        # itself would stop it should the attack succeed.
        result["ptrace"] = libc.ptrace(PTRACE_ATTACH, params["victim"], 0, 0)
        result["uid"] = os.getuid()
        status = open("/proc/self/status").read()
        result["capeff"] = status.split("CapEff:")[1].split()[0]
        result["nonewprivs"] = status.split("NoNewPrivs:")[1].split()[0]
    """,
        runner=os.getpid(),
        victim=victim.pid,
    )
    victim.kill()
    victim.wait()
    assert result["signal"] == "ProcessLookupError"
    assert result["ptrace"] == -1
    assert result["uid"] != 0
    assert result["capeff"] == "0000000000000000"
    assert result["nonewprivs"] == "1"


FORK_BOMB = """
import json, os, sys, time
sys.stdin.read()
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
except OSError:
    pass
print(json.dumps({"children": children}), file=sys.stderr)
sys.exit(3)
"""


def test_a_fork_bomb_hits_max_pids_and_the_host_can_still_fork(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("bomb", FORK_BOMB, limits={"max_pids": 32})
    answer = bench.runner().handle({"toolName": "bomb", "requestId": "req_bomb", "options": {"retries": 0}})
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "pids_limit"
    no_survivors("req_bomb")
    assert subprocess.run(["true"], check=False).returncode == 0


FOUR_CHILDREN = """
import json, os, sys, time
sys.stdin.read()
for _ in range(4):
    if os.fork() == 0:
        block = bytearray(90 * 1024 * 1024)  # each under the limit, together far past it
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(10)
        os._exit(0)
for _ in range(4):
    os.wait()
print("{}")
"""


def test_the_memory_limit_holds_for_all_children_together(
    bench: ToolBench, no_survivors: Callable[[str], None]
) -> None:
    bench.tool("family", FOUR_CHILDREN, limits={"memory_mb": 128, "timeout_ms": 8000})
    answer = bench.runner().handle(
        {"toolName": "family", "requestId": "req_family", "options": {"retries": 0}}
    )
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "memory_limit"
    no_survivors("req_family")


HOG = """
import json, sys
sys.stdin.read()
blocks = [bytearray(8 * 1024 * 1024) for _ in range(64)]
print("{}")
"""


def test_six_hogs_in_parallel_are_each_held_to_their_own_limit(bench: ToolBench) -> None:
    import asyncio

    bench.tool("hog", HOG, limits={"memory_mb": 64, "timeout_ms": 10000})
    bench.tool(
        "modest",
        "import sys\nsys.stdin.read()\nblock = bytearray(40 * 1024 * 1024)\nprint('{}')\n",
        limits={"memory_mb": 64},
    )
    runner = bench.runner()

    async def together() -> list[CallResult]:
        calls = [runner.acall("hog", retries=0) for _ in range(6)]
        calls.append(runner.acall("modest", retries=0))
        return await asyncio.gather(*calls)

    results = asyncio.run(together())
    reasons = [r.error.details["reason"] if r.error else None for r in results[:6]]
    assert reasons == ["memory_limit"] * 6
    assert results[6].success is True


def test_killing_the_runner_mid_call_takes_every_tool_process_with_it(bench: ToolBench) -> None:
    bench.tool(
        "sleeper",
        """
        import os, sys, time
        sys.stdin.read()
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        time.sleep(60)
    """,
    )
    proc = bench.spawn_runner("sleeper", "req_orphan")
    marker = "REQUEST_ID=req_orphan"
    deadline = time.monotonic() + 10
    while len(processes_with_env(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(processes_with_env(marker)) >= 2, "the tool never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 2.0
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_env(marker) == []


def test_a_missing_launcher_fails_closed_with_sandbox_unavailable(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNNER_BWRAP", "/nonexistent/bwrap")
    bench.tool("ok", "import sys\nsys.stdin.read()\nprint('{}')\n")
    answer = bench.runner().handle({"toolName": "ok", "options": {"retries": 3}})
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "bubblewrap" in answer["error"]["message"]
    assert answer["metadata"]["attempts"] == 1  # retrying cannot install bubblewrap


def test_degraded_runs_need_the_policy_to_say_so_and_are_marked(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNNER_BWRAP", "/nonexistent/bwrap")
    bench.policy["sandbox"] = {"backends": {"subprocess": {"allow_degraded": True}}}
    bench.tool("ok", "import sys\nsys.stdin.read()\nprint('{}')\n")
    answer = bench.runner().handle({"toolName": "ok"})
    assert answer["success"] is True
    assert answer["metadata"]["degraded"] is True
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    assert [e["degraded"] for e in events if e["event"] == "call.attempt"] == [True]


def test_leftovers_of_a_killed_runner_are_removed_on_start(tmp_path: Path) -> None:
    from sandboxes.subprocess import SubprocessConfig, SubprocessSandbox
    from sandboxes.subprocess._cgroup import CgroupFactory, CgroupUnavailable

    dead_pid = 2**22 + 1  # above the most pid_max can be: never alive
    try:
        factory = CgroupFactory()
    except CgroupUnavailable as exc:  # rootless on cgroup v1: no call cgroups to leave
        pytest.skip(str(exc))
    stale = [parent / f"{dead_pid}-1-1" for parent in factory.parents]
    for d in stale:
        d.mkdir()
    scratch = tmp_path / "state" / "scratch" / f"{dead_pid}-7"
    scratch.mkdir(parents=True)
    SubprocessSandbox(SubprocessConfig(state_dir=tmp_path / "state")).set_up()  # what first use does
    assert not any(d.exists() for d in stale)
    assert not scratch.exists()


def test_sandbox_unavailable_messages_show_no_host_paths(bench: ToolBench) -> None:
    from runner.call.outcomes import failure_error
    from sandboxes import SandboxOutcome, StopReason

    bench.tool("ok", "print('{}')\n")
    tool = bench.runner().registry.get("ok")
    outcome = SandboxOutcome(
        exit_code=1,
        signal=None,
        stdout=b"",
        stderr_tail="",
        duration_ms=1,
        reason=StopReason.SANDBOX_UNAVAILABLE,
        message=f"bwrap: Can't find source path {bench.root}/secret-place: No such file",
    )
    assert tool is not None
    message = failure_error(tool, outcome, 1000, by_deadline=False).message
    assert "secret-place" not in message
    assert str(bench.root) not in message
    assert "Can't find source path" in message


def test_the_tool_cannot_make_a_user_namespace_or_write_dev(bench: ToolBench, mode: str) -> None:
    result = attack(
        bench,
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWUSER = 0x10000000
        result["unshare"] = libc.unshare(CLONE_NEWUSER)
        try:
            open("/dev/planted", "w").write("x")
            result["dev"] = "written"
        except OSError as exc:
            result["dev"] = type(exc).__name__
    """,
    )
    assert result["unshare"] == -1
    assert result["dev"] != "written"


def test_the_tool_has_a_uid_of_its_own_on_the_host_side(bench: ToolBench) -> None:
    if os.geteuid() != 0:
        pytest.skip("only a root runner changes user; otherwise the tool is the runner's own user")
    bench.tool("idle", "import sys, time\nsys.stdin.read()\ntime.sleep(1.5)\nprint('{}')\n")
    bench.policy["tools"] = {"idle": {"pool": 0}}  # found by its REQUEST_ID: cold (forked: test_fork_mode.py)
    runner = bench.runner()
    done: list[dict[str, Any]] = []
    caller = threading.Thread(
        target=lambda: done.append(runner.handle({"toolName": "idle", "requestId": "req_uid"}))
    )
    caller.start()
    deadline = time.monotonic() + 5
    pids: list[int] = []
    while not pids and time.monotonic() < deadline:
        pids = processes_with_env("REQUEST_ID=req_uid")
        time.sleep(0.05)
    uids = set()
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        uids.add(status.split("Uid:")[1].split()[0])
    caller.join(10)
    assert done[0]["success"] is True
    assert pids, "the tool never showed up in /proc"
    # As seen from the host, not just inside the user namespace (where it is 65534).
    (uid,) = uids
    assert UID_BASE <= int(uid) < UID_BASE + UID_COUNT
