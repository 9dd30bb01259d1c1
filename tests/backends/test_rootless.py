"""The runner as a user who is not root: the first run, what ``runner doctor`` says, no
``/tmp`` shared between calls, nothing written outside the user's own folders.

Run by ``scripts/test-rootless.sh`` as an unprivileged user (with the contract kit, the
isolation, kill-guarantee and pool tests, which hold for a user too); as root these
tests have nothing to test and skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, call_cgroups, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() == 0, reason="about a runner that is not root: scripts/test-rootless.sh runs it as a user"
)

# Where a user could write beyond its home and /tmp (what the runner must leave alone).
SHARED_WRITABLE = ("/var/tmp", "/dev/shm", "/run", "/sys/fs/cgroup")


@pytest.fixture
def user_dirs(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment whose HOME and XDG folders are fresh folders of this user's."""
    home = tmp_path / "home"
    env = dict(os.environ)
    env.update(
        HOME=str(home),
        XDG_RUNTIME_DIR=str(home / "run"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_DATA_HOME=str(home / "data"),
    )
    for name in ("RUNNER_POLICIES", "RUNNER_TOOLS", "RUNNER_AUDIT_LOG"):
        env.pop(name, None)
    (home / "run").mkdir(parents=True, mode=0o700)
    yield env


def _cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _owned_files(roots: tuple[str, ...]) -> set[str]:
    """Paths under ``roots`` owned by this user (not following symlinks)."""
    found: set[str] = set()
    for root in roots:
        for folder, dirs, files in os.walk(root, onerror=lambda _: None):
            for name in dirs + files:
                path = os.path.join(folder, name)
                try:
                    if os.lstat(path).st_uid == os.geteuid():
                        found.add(path)
                except OSError:
                    continue
    return found


def test_init_then_exec_answers_3_and_writes_only_in_the_users_folders(
    user_dirs: dict[str, str], tmp_path: Path
) -> None:
    before = _owned_files(SHARED_WRITABLE)
    work = tmp_path / "work"
    work.mkdir()
    assert _cli(user_dirs, work, "init").returncode == 0
    done = _cli(user_dirs, work, "exec", "add_numbers", "--params", '{"a": 1, "b": 2}')
    answer: dict[str, Any] = json.loads(done.stdout)
    assert answer["result"] == 3, answer
    assert _owned_files(SHARED_WRITABLE) - before == set()
    # The runner's state is under $XDG_RUNTIME_DIR; nothing else of the home was made.
    home = Path(user_dirs["HOME"])
    assert (home / "run" / "runner").is_dir()
    made = {path.relative_to(home).parts[0] for path in home.iterdir()}
    assert made <= {"run", "cache", "config", "data"}, made


def test_serve_socket_starts_in_the_runtime_folder_a_call_has_used(
    user_dirs: dict[str, str], tmp_path: Path
) -> None:
    # Without root the state folder is the socket's folder: the first call made it 0755,
    # and `runner serve --socket` then refused it for good (it must be 0700).
    work = tmp_path / "work"
    work.mkdir()
    assert _cli(user_dirs, work, "init").returncode == 0
    done = _cli(user_dirs, work, "exec", "add_numbers", "--params", '{"a": 1, "b": 2}')
    assert json.loads(done.stdout)["result"] == 3, done.stdout
    socket_path = Path(user_dirs["XDG_RUNTIME_DIR"]) / "runner" / "serve.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "runner", "serve", "--socket"],
        env=user_dirs,
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            if socket_path.is_socket() or server.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert server.poll() is None, server.communicate(timeout=10)[1]
        assert socket_path.is_socket()
        assert (socket_path.parent.stat().st_mode & 0o777) == 0o700
    finally:
        server.terminate()
        server.communicate(timeout=30)
    # Opened to the uids a shared socket admits (serve.socket.uids), it stays so: a call
    # made it 0700, and they could no longer reach the socket.
    socket_path.parent.chmod(0o711)
    done = _cli(user_dirs, work, "exec", "add_numbers", "--params", '{"a": 1, "b": 2}')
    assert json.loads(done.stdout)["result"] == 3, done.stdout
    assert (socket_path.parent.stat().st_mode & 0o777) == 0o711


def test_doctor_says_rootless_names_the_fix_and_marks_nothing_ok_that_fails(
    user_dirs: dict[str, str], tmp_path: Path
) -> None:
    done = _cli(user_dirs, tmp_path, "doctor", "--json")
    layers = {(layer["backend"], layer["name"]): layer for layer in json.loads(done.stdout)}
    assert layers[("subprocess", "rootless")]["ok"]
    assert layers[("subprocess", "hardened sandbox")]["ok"], layers[("subprocess", "hardened sandbox")]
    assert "rootless" in layers[("subprocess", "hardened sandbox")]["detail"]
    assert layers[("subprocess", "workspace staging")]["ok"], layers[("subprocess", "workspace staging")]
    if not call_cgroups():
        cgroups = layers[("subprocess", "cgroups")]
        assert not cgroups["ok"]
        assert "cgroup v2" in cgroups["hint"] or "delegated" in cgroups["hint"]
        assert layers[("subprocess", "rootless limits")]["ok"]
    # Both networks hold without root; slirp4netns only needs /dev/net/tun open to the user.
    assert layers[("subprocess", "egress network")]["ok"], layers[("subprocess", "egress network")]
    own = layers[("subprocess", "own network")]
    if os.access("/dev/net/tun", os.R_OK | os.W_OK):
        assert own["ok"], own
    else:
        assert not own["ok"] and "chmod 0666 /dev/net/tun" in own["hint"]
    docker = layers[("docker", "docker")]
    if not docker["ok"] and "permission denied" in docker["detail"]:
        assert "docker group" in docker["hint"] and "DOCKER_HOST" in docker["hint"]


TMP_PROBE = """
import json, os, sys, time
marker = sys.argv[1]
sys.stdin.read()
open(os.path.join("/tmp", marker), "w").close()
time.sleep(1.0)  # both calls hold their /tmp at once
print(json.dumps({"tmp": sorted(os.listdir("/tmp"))}))
"""


def test_two_concurrent_calls_share_no_tmp(bench: ToolBench) -> None:
    bench.tool("probe_a", TMP_PROBE, command=["python3", "main.py", "mark-a"])
    bench.tool("probe_b", TMP_PROBE, command=["python3", "main.py", "mark-b"])
    answers: dict[str, dict[str, Any]] = {}
    with bench.runner() as runner:

        def call(tool: str) -> None:
            answers[tool] = runner.handle({"toolName": tool, "options": {"retries": 0}})

        threads = [threading.Thread(target=call, args=(tool,)) for tool in ("probe_a", "probe_b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert answers["probe_a"]["result"]["tmp"] == ["mark-a"], answers["probe_a"]
    assert answers["probe_b"]["result"]["tmp"] == ["mark-b"], answers["probe_b"]


def test_the_process_cap_counts_the_sandbox_not_the_users_other_processes(bench: ToolBench) -> None:
    # The user has more processes than the cap outside; the tool may still start children.
    others = [subprocess.Popen(["sleep", "30"]) for _ in range(12)]
    try:
        bench.tool(
            "forks",
            """
import json, os, sys, time
sys.stdin.read()
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    pids.append(pid)
print(json.dumps({"children": len(pids)}))
""",
            limits={"max_pids": 8},
        )
        with bench.runner() as runner:
            answer = runner.handle({"toolName": "forks", "options": {"retries": 0}})
    finally:
        for other in others:
            other.kill()
            other.wait()
    assert answer["result"] == {"children": 4}, answer


WARM_HOG = """
import json, os, sys, time
for _ in range(3):  # before its input: while it waits in a pool
    if os.fork() == 0:
        held = bytearray(100 * 2**20)
        time.sleep(120)
        os._exit(0)
time.sleep(1)
sys.stdin.read()
print(json.dumps("fine"))
"""


def test_a_warm_sandbox_whose_processes_pass_the_memory_limit_is_never_handed_out(bench: ToolBench) -> None:
    # Without a cgroup only each process has its rlimit: the sums over the processes
    # were looked at only while a call ran, so a warm sandbox held 300 MB of a 64 MB
    # limit while it waited, and its call then answered a success.
    bench.tool("warmhog", WARM_HOG, limits={"memory_mb": 64})
    bench.policy["tools"] = {"warmhog": {"pool": 1}}

    def discarded() -> list[dict[str, Any]]:
        lines = bench.audit_log.read_text().splitlines() if bench.audit_log.exists() else []
        return [event for line in lines if (event := json.loads(line))["event"] == "pool.discarded"]

    with bench.runner() as runner:
        wait_for(lambda: any(event["reason"] == "limit" for event in discarded()), 30.0)
        answer = runner.handle({"toolName": "warmhog"})
    assert not answer["success"], answer
    assert answer["error"]["details"]["reason"] == "memory_limit", answer["error"]
    assert "memory limit" in next(e["detail"] for e in discarded() if e["reason"] == "limit")


def test_a_max_pids_above_the_users_own_hard_limit_runs_under_that_limit(bench: ToolBench) -> None:
    # The shim's `ulimit -p` failed past the hard limit: every call "could not be set up".
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    if hard == resource.RLIM_INFINITY or hard >= 1 << 22:
        pytest.skip("this user's process limit has no hard bound below the runner's own")
    reading = "import json, resource, sys\nsys.stdin.read()\nprint(json.dumps(resource.getrlimit(resource.RLIMIT_NPROC)))\n"
    bench.tool("many", reading, limits={"max_pids": hard + 1})
    bench.policy["limits"]["max_pids"] = hard + 1
    answer = bench.runner().handle({"toolName": "many"})
    assert answer["success"], answer["error"]
    assert answer["result"][0] == hard
