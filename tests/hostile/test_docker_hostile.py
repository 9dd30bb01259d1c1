"""Hostile tools against the docker backend's limits: each attack is one the security review
made work (issue 8: TCP buffers, the daemon's log, CPU, memory and pids of several processes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import HOARDING_CHILDREN, SPINNING_CHILDREN, ToolBench
from docker import APIClient
from support.socket_hoard import (
    SOCKET_HOARDER,
    UNACCEPTED_HOARDER,
    assert_sockets_held,
    assert_unaccepted_held,
)

from sandboxes.base import LaunchSpec, Limits, SandboxOutcome
from sandboxes.docker import DockerSandbox

pytestmark = pytest.mark.docker

MiB = 1024 * 1024


def docker_tool(bench: ToolBench, name: str, code: str, **manifest: object) -> None:
    bench.tool(name, code, sandbox="docker", image="runner/base:latest", **manifest)


def call(bench: ToolBench, tool: str, timeout_ms: int) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    answer = bench.runner().handle({"toolName": tool, "options": {"timeout": timeout_ms, "retries": 0}})
    return answer, time.monotonic() - started


def test_thousands_of_loopback_connections_cannot_pin_more_than_the_memory_limit(bench: ToolBench) -> None:
    # 4,000 connections, each holding the minimum the kernel lets a socket keep past the
    # cgroup's TCP limit: 340 MB queued at memory_mb 256 before they were stopped.
    docker_tool(bench, "hoarder", SOCKET_HOARDER, limits={"memory_mb": 256, "timeout_ms": 30000})
    answer, _ = call(bench, "hoarder", timeout_ms=30000)
    assert_sockets_held(answer, 256)


def test_connections_nobody_accepts_cannot_pin_more_than_the_memory_limit(bench: ToolBench) -> None:
    # Charged to no cgroup: 100 such connections held 479 MB at memory_mb 256 before.
    command = ["python3", "main.py", str(256 * MiB)]
    limits = {"memory_mb": 128, "timeout_ms": 30000}
    docker_tool(bench, "unaccepted", UNACCEPTED_HOARDER, limits=limits, command=command)
    answer, _ = call(bench, "unaccepted", timeout_ms=30000)
    assert_unaccepted_held(answer, 128)


UDP_HOARDER = """
import json, socket, sys
sys.stdin.read()

def queued():  # bytes waiting in every receive queue of the container's network namespace
    rows = open("/proc/net/udp").read().splitlines()[1:]
    return sum(int(row.split()[4].split(":")[1], 16) for row in rows)

sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sender.setblocking(False)
receivers, datagram, total = [], b"x" * 60000, 0
while total < 300 * 1024 * 1024 and len(receivers) < 400:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024 * 1024)
    receiver.bind(("127.0.0.1", 0))
    receivers.append(receiver)  # never read
    for _ in range(200):
        try:
            sender.sendto(datagram, receiver.getsockname())
        except BlockingIOError:
            pass
    total = queued()
json.dump({"queued": total, "sockets": len(receivers)}, sys.stdout)
"""


def test_udp_datagrams_queued_on_loopback_are_held_within_the_memory_limit(
    bench: ToolBench, docker_client: APIClient
) -> None:
    docker_tool(bench, "udp_hoarder", UDP_HOARDER, limits={"memory_mb": 64})
    answer, _ = call(bench, "udp_hoarder", timeout_ms=30000)
    if answer["success"]:
        assert answer["result"]["queued"] < 64 * MiB, answer["result"]
    else:
        assert answer["error"]["details"]["reason"] == "memory_limit"


def run_directly(tool_dir: Path, limits: Limits, inspect: Any) -> tuple[SandboxOutcome, Any]:
    """One attempt through the backend itself, with ``inspect(container_id)`` taken after
    the run and before the container is removed."""

    async def attempt() -> tuple[SandboxOutcome, Any]:
        spec = LaunchSpec(
            tool_name=tool_dir.name,
            request_id="req_docker_hostile",
            command=("python3", "main.py"),
            tool_dir=tool_dir,
            image="runner/base:latest",
        )
        prepared = await DockerSandbox().prepare(spec, limits)
        try:
            outcome = await prepared.run(b"{}")
            return outcome, await asyncio.to_thread(inspect, prepared.container_id)
        finally:
            await prepared.close()

    return asyncio.run(attempt())


def test_a_stderr_flood_leaves_no_daemon_log_and_its_tail_still_arrives(
    bench: ToolBench, docker_client: APIClient
) -> None:
    flood = """
import sys
sys.stdin.read()
line = b"e" * 1023 + b"\\n"
for _ in range(48 * 1024):
    sys.stderr.buffer.write(line)
sys.stderr.buffer.write(b"END-OF-FLOOD\\n")
"""
    folder = bench.tool("flood", flood)

    def log_of(container_id: str) -> tuple[str, str, int]:
        info = docker_client.inspect_container(container_id)
        path = info.get("LogPath") or ""
        size = Path(path).stat().st_size if path and Path(path).exists() else 0
        return info["HostConfig"]["LogConfig"]["Type"], path, size

    outcome, (driver, path, size) = run_directly(folder, Limits(timeout_ms=20000), log_of)
    assert outcome.ok, outcome
    assert outcome.stderr_tail.endswith("END-OF-FLOOD\n")
    assert driver == "none"
    assert (path, size) == ("", 0)


def test_eight_spinning_processes_are_stopped_at_the_cpu_budget_of_the_whole_container(
    bench: ToolBench, docker_client: APIClient
) -> None:
    docker_tool(bench, "spinners", SPINNING_CHILDREN, limits={"cpu_seconds": 2})
    answer, elapsed = call(bench, "spinners", timeout_ms=20000)
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "cpu_limit"
    assert elapsed < 8  # one CPU at most: 2 CPU-seconds take about 2 s


def test_a_child_killed_for_memory_while_its_parent_waits_ends_the_call_with_memory_limit(
    bench: ToolBench, docker_client: APIClient
) -> None:
    docker_tool(bench, "hog_children", HOARDING_CHILDREN, limits={"memory_mb": 64})
    answer, elapsed = call(bench, "hog_children", timeout_ms=10000)
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "memory_limit"
    assert elapsed < 6


def test_a_fork_bomb_that_then_waits_ends_with_pids_limit_not_timeout(
    bench: ToolBench, docker_client: APIClient
) -> None:
    bomb = """
import os, sys, time
sys.stdin.read()
try:
    for _ in range(10000):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
except OSError:
    pass
time.sleep(60)  # holds every process it got until the call's timeout
"""
    docker_tool(bench, "waiting_bomb", bomb, limits={"max_pids": 32})
    answer, _ = call(bench, "waiting_bomb", timeout_ms=3000)
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "pids_limit"


def test_a_v1_host_where_the_tcp_limit_cannot_be_set_refuses_to_run_the_tool(
    bench: ToolBench, docker_client: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    if str(docker_client.info().get("CgroupVersion")) == "2":
        pytest.skip("cgroup v2 charges socket buffers to memory.max; there is no separate limit")
    from sandboxes.docker._cgroup import ContainerCgroup

    def refuse(self: ContainerCgroup, limit_bytes: int) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ContainerCgroup, "limit_tcp_memory", refuse)
    docker_tool(bench, "echo", "import sys\nprint(sys.stdin.read())\n")
    answer = bench.runner().handle(
        {"toolName": "echo", "requestId": "req_docker_no_tcp_limit", "options": {"retries": 2}}
    )
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert answer["metadata"]["attempts"] == 1
    assert (
        docker_client.containers(all=True, filters={"label": "io.runner.request-id=req_docker_no_tcp_limit"})
        == []
    )
