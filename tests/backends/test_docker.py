"""The docker backend against a real daemon: isolation, faults mapped, cleanup always."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, starter_dir
from docker import APIClient

from runner import Runner
from sandboxes._identity import UID_BASE, UID_COUNT

pytestmark = pytest.mark.docker

PROBE = """
import json, os, socket, sys
params = json.load(sys.stdin)["params"]
result = {"uid": os.getuid(), "interfaces": sorted(os.listdir("/sys/class/net"))}
try:
    socket.create_connection(("127.0.0.1", params["port"]), timeout=2).close()
    result["connected"] = True
except OSError:
    result["connected"] = False
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
result["capeff"] = status.get("CapEff", "").strip()
result["nonewprivs"] = status.get("NoNewPrivs", "").strip()  # gVisor does not report it
result["kernel"] = open("/proc/version").read()
json.dump(result, sys.stdout)
"""


def docker_tool(bench: ToolBench, name: str, code: str, **manifest: object) -> None:
    bench.tool(name, code, sandbox="docker", image="runner/base:latest", **manifest)


def ours(client: APIClient, request_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = client.containers(
        all=True, filters={"label": f"io.runner.request-id={request_id}"}
    )
    return found


def test_a_shipped_docker_tool_answers(docker_client: APIClient) -> None:
    runner = Runner.load(
        tools=starter_dir() / "tools", policies=starter_dir() / "policies.yaml", audit_log=os.devnull
    )
    answer = runner.handle({"toolName": "word_count", "params": {"text": "one two\nthree"}})
    assert answer["result"] == {"lines": 2, "words": 3, "characters": 13}


def test_the_container_has_no_network_no_capabilities_and_no_root(
    bench: ToolBench, docker_client: APIClient
) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3)
    accepted: list[bool] = []
    thread = threading.Thread(target=lambda: accepted.append(_accepts(server)), daemon=True)
    thread.start()
    docker_tool(bench, "probe", PROBE)
    answer = bench.runner().handle({"toolName": "probe", "params": {"port": server.getsockname()[1]}})
    thread.join(5)
    server.close()
    result = answer["result"]
    assert result["connected"] is False
    assert accepted == [False]
    assert result["interfaces"] == ["lo"]
    assert UID_BASE <= result["uid"] < UID_BASE + UID_COUNT  # a uid of its own, never root or nobody
    assert result["capeff"] == "0000000000000000"
    assert result["nonewprivs"] == "1"


def _accepts(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except OSError:
        return False


def test_a_timed_out_container_is_killed_and_removed(bench: ToolBench, docker_client: APIClient) -> None:
    docker_tool(bench, "sleepy", "import sys, time\nsys.stdin.read()\ntime.sleep(60)\n")
    started = time.monotonic()
    with bench.runner() as runner:  # dead containers are removed off the call's path: by close
        answer = runner.handle(
            {
                "toolName": "sleepy",
                "requestId": "req_docker_timeout",
                "options": {"timeout": 500, "retries": 1, "retryDelay": 10},
            }
        )
        assert not [c for c in ours(docker_client, "req_docker_timeout") if c["State"] == "running"]
    assert answer["error"]["code"] == "TIMEOUT"
    assert answer["metadata"]["attempts"] == 2
    assert time.monotonic() - started < 6
    assert ours(docker_client, "req_docker_timeout") == []


def test_a_fork_bomb_is_held_by_the_pids_limit(bench: ToolBench, docker_client: APIClient) -> None:
    bomb = """
import os, sys, time
sys.stdin.read()
n = 0
try:
    while n < 10000:
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        n += 1
except OSError:
    print(n, file=sys.stderr)
    time.sleep(0.5)  # a bomb keeps pushing against the limit for a while
    sys.exit(3)
"""
    docker_tool(bench, "bomb", bomb, limits={"max_pids": 32})
    with bench.runner() as runner:  # dead containers are removed off the call's path: by close
        answer = runner.handle(
            {"toolName": "bomb", "requestId": "req_docker_bomb", "options": {"retries": 0}}
        )
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "pids_limit"
    assert int(answer["error"]["details"]["stderr"].strip()) < 32
    assert subprocess.run(["true"], check=False).returncode == 0
    assert ours(docker_client, "req_docker_bomb") == []


def test_an_unreachable_daemon_is_sandbox_unavailable_quickly(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    docker_tool(bench, "any", "print(1)")
    started = time.monotonic()
    answer = bench.runner().handle({"toolName": "any", "options": {"retries": 3}})
    assert time.monotonic() - started < 3
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "Docker daemon" in answer["error"]["message"]


def test_a_missing_image_is_sandbox_unavailable_with_the_fix(
    bench: ToolBench, docker_client: APIClient
) -> None:
    bench.tool("lost", "print(1)", sandbox="docker", image="runner/does-not-exist:latest")
    answer = bench.runner().handle({"toolName": "lost"})
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "runner images build" in answer["error"]["message"]
    assert answer["metadata"]["attempts"] == 1


def test_containers_left_by_a_killed_runner_are_removed_on_start(docker_client: APIClient) -> None:
    from sandboxes.docker import DockerSandbox
    from sandboxes.docker._client import LABEL_MANAGED, LABEL_OWNER, LABEL_REQUEST

    created = docker_client.create_container(
        "runner/base:latest",
        command=["sleep", "60"],
        labels={LABEL_MANAGED: "true", LABEL_OWNER: str(2**22 + 1), LABEL_REQUEST: "req_leftover"},
    )
    docker_client.start(created["Id"])
    DockerSandbox().client()
    assert ours(docker_client, "req_leftover") == []


def test_a_runner_in_another_pid_namespace_leaves_a_live_runners_container_alone(
    bench: ToolBench, docker_client: APIClient
) -> None:
    # Its pids are not ours: the live runner's pid is not found from in there.
    docker_tool(bench, "sleeper", "import sys, time\nsys.stdin.read()\ntime.sleep(60)\n")
    proc = bench.spawn_runner("sleeper", "req_docker_other_space")
    try:
        deadline = time.monotonic() + 60  # generous: the first container of a quiet daemon is slow
        while not ours(docker_client, "req_docker_other_space") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ours(docker_client, "req_docker_other_space"), "the container never appeared"
        starting = "from sandboxes.docker import DockerSandbox; DockerSandbox().client()"
        subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", starting],
            check=True,
            timeout=60,
        )
        assert ours(docker_client, "req_docker_other_space"), "another namespace's runner removed it"
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def sleeping_in_a_pid_namespace(
    bench: ToolBench, docker_client: APIClient, request_id: str
) -> Iterator[None]:
    """A runner in a pid namespace of its own, its docker call sleeping; at the end the
    namespace's init is killed, and every process in it (the runner, its watchdog) with it."""
    import psutil

    docker_tool(bench, "sleeper", "import sys, time\nsys.stdin.read()\ntime.sleep(60)\n")
    argv = ["unshare", "--pid", "--fork", "--mount-proc", *bench.runner_argv("sleeper", request_id)]
    unshared = subprocess.Popen(argv, cwd=bench.root)
    try:
        deadline = time.monotonic() + 60
        while not ours(docker_client, request_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ours(docker_client, request_id), "the container never appeared"
        yield
    finally:
        inside = psutil.Process(unshared.pid).children(recursive=True)
        if inside:
            inside[0].kill()
        psutil.wait_procs(inside, timeout=30)
        unshared.kill()
        unshared.wait()


def test_a_container_of_a_pid_namespace_that_is_gone_is_removed_by_the_next_runner(
    bench: ToolBench, docker_client: APIClient
) -> None:
    # Its runner and watchdog died with their namespace; the next runner, in another
    # namespace, skipped the container for good.
    from sandboxes.docker import DockerSandbox

    with sleeping_in_a_pid_namespace(bench, docker_client, "req_docker_dead_space"):
        pass
    assert ours(docker_client, "req_docker_dead_space"), "nothing was left to sweep"
    DockerSandbox().client()  # what a starting runner does first
    assert ours(docker_client, "req_docker_dead_space") == []


NOT_ROOT_SWEEP = """
import grp, os
import docker
from sandboxes.docker._client import api_client
from sandboxes.docker.sandbox import remove_leftovers
os.setgroups([grp.getgrnam("docker").gr_gid])  # a user of the docker group, as documented
os.setgid(65534)
os.setuid(65534)
print(remove_leftovers(api_client()))
"""


def test_a_runner_that_is_not_root_leaves_another_namespaces_live_container_alone(
    bench: ToolBench, docker_client: APIClient
) -> None:
    # Without root it could not read the namespaces of root's processes, took their pid
    # namespace for one with no process left, and removed a live call's container.
    from sandboxes.docker import DockerSandbox

    with sleeping_in_a_pid_namespace(bench, docker_client, "req_docker_root_space"):
        subprocess.run([sys.executable, "-c", NOT_ROOT_SWEEP], check=True, timeout=60)
        assert ours(docker_client, "req_docker_root_space"), "a live call's container was removed"
    DockerSandbox().client()  # the namespace gone, its container is swept
    assert ours(docker_client, "req_docker_root_space") == []


HOSTILE_IMAGE = "runner-test/entrypoint-and-volume:latest"
SHM_AND_ANSWER = """
import json, os, sys
params = json.loads(sys.stdin.read())["params"]
shm = os.statvfs("/dev/shm")
print(json.dumps({"echo": params, "shm_mb": shm.f_blocks * shm.f_frsize // 2**20}))
"""


def test_an_images_entrypoint_never_runs_and_its_volume_goes_with_the_container(
    bench: ToolBench, docker_client: APIClient
) -> None:
    # An image's ENTRYPOINT got the gate as arguments, and read the release (the secrets)
    # on its stdin; a VOLUME outlived the container; /dev/shm was Docker's 64 MB.
    dockerfile = (
        b'FROM runner/base:latest\nVOLUME /data\nENTRYPOINT ["/bin/echo", "{\\"hijacked\\": true}"]\n'
    )
    import io

    for _ in docker_client.build(fileobj=io.BytesIO(dockerfile), tag=HOSTILE_IMAGE, rm=True, pull=False):
        pass
    volumes_before = {v["Name"] for v in docker_client.volumes().get("Volumes") or []}
    bench.tool("hostile_image", SHM_AND_ANSWER, sandbox="docker", image=HOSTILE_IMAGE, limits={"disk_mb": 16})
    runner = bench.runner()
    answer = runner.handle({"toolName": "hostile_image", "params": {"n": 1}})
    runner.close()  # the container is removed after the answer: by the close at the latest
    assert answer["success"], answer["error"]
    assert answer["result"] == {"echo": {"n": 1}, "shm_mb": 16}
    volumes_after = {v["Name"] for v in docker_client.volumes().get("Volumes") or []}
    assert volumes_after <= volumes_before, "the image's VOLUME was left behind"


def test_gvisor_runs_a_tool_when_the_policy_names_it(bench: ToolBench, docker_client: APIClient) -> None:
    if "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("runsc is not registered with dockerd (scripts/setup.sh registers it)")
    docker_tool(bench, "probe", PROBE)
    bench.policy["tools"] = {"probe": {"runtime": "runsc"}}
    answer = bench.runner().handle(
        {"toolName": "probe", "params": {"port": 9}, "options": {"timeout": 20000}}
    )
    assert answer["success"], answer["error"]
    host_kernel = Path("/proc/version").read_text()
    assert answer["result"]["kernel"] != host_kernel  # gVisor's own kernel answers
    assert answer["result"]["connected"] is False


def test_a_container_left_by_a_killed_runner_is_removed_by_the_next_one(
    bench: ToolBench, docker_client: APIClient
) -> None:
    import signal

    docker_tool(bench, "sleeper", "import sys, time\nsys.stdin.read()\ntime.sleep(60)\n")
    proc = bench.spawn_runner("sleeper", "req_docker_orphan")
    deadline = time.monotonic() + 15
    while not ours(docker_client, "req_docker_orphan") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours(docker_client, "req_docker_orphan"), "the container never appeared"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from sandboxes.docker import DockerSandbox

    DockerSandbox().client()  # what a starting runner does first
    assert ours(docker_client, "req_docker_orphan") == []
