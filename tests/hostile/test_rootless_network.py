"""A networked tool of a runner that is not root: its network namespace is its own, the
host's loopback (every service listening there, the runner's own included) is out of its
reach, it cannot change its interfaces, and its slirp4netns ends with the call and with a
SIGKILLed runner. ``scripts/test-rootless.sh`` runs these as an unprivileged user.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import ToolBench, assert_nothing_survives, wait_for
from test_network import Greeter, probe

from sandboxes.subprocess import _network

pytestmark = pytest.mark.skipif(
    os.geteuid() == 0, reason="about a runner that is not root: scripts/test-rootless.sh runs it as a user"
)
GRACE_S = 1.0

# Tries to take its interfaces down (the way out, and loopback where the proxy listens).
UNPLUG = """
import fcntl, json, socket, struct, sys
json.load(sys.stdin)
result = {}
for name in (b"tap0", b"lo"):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            fcntl.ioctl(probe, 0x8914, struct.pack("16sH14x", name, 0))  # SIOCSIFFLAGS: down
            result[name.decode()] = "down"
        except OSError as exc:
            result[name.decode()] = type(exc).__name__
json.dump(result, sys.stdout)
"""
SLEEPER = "import sys, time\nsys.stdin.read()\ntime.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 30)\nprint('{}')\n"


@pytest.fixture
def runners_port() -> Iterator[Greeter]:
    """A service of the runner's own process (the runner is in-process here) on the host's loopback."""
    greeter = Greeter(socket.create_server(("127.0.0.1", 0)))
    yield greeter
    greeter.close()


def _host_loopback_listeners() -> list[int]:
    """The TCP ports listening on the host's 127.0.0.0/8, whoever's they are."""
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _, state = line.split()[1:4]
        address, port = local.split(":")
        if state == "0A" and address.endswith("7F"):  # LISTEN, 127.x.x.x (little-endian)
            ports.add(int(port, 16))
    return sorted(ports)


def _slirps(parent: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(parent).children() if p.name() == "slirp4netns"]
    except psutil.NoSuchProcess:
        return []


def test_the_hosts_loopback_services_and_the_runners_are_out_of_reach(
    bench: ToolBench, runners_port: Greeter
) -> None:
    ports = _host_loopback_listeners()
    own = runners_port.server.getsockname()[1]
    assert own in ports
    chosen = sorted({own, *ports[:40]})  # the runner's own port always among them
    targets = [f"{host}:{port}" for port in chosen for host in ("127.0.0.1", "10.0.2.2")]
    result = probe(bench, targets)
    assert {target: result[target] for target in targets if result[target] == "hello"} == {}
    assert all(
        result[target] in {"ConnectionRefusedError", "TimeoutError", "OSError"} for target in targets
    ), result
    assert runners_port.connections == 0
    assert result["interfaces"] == ["lo", "tap0"]


@pytest.mark.parametrize("degraded", [False, True], ids=["hardened", "degraded"])
def test_a_networked_tool_cannot_take_its_interfaces_down(bench: ToolBench, degraded: bool) -> None:
    bench.tool("unplug", UNPLUG, network=True)
    bench.policy["limits"]["network"] = True
    if degraded:  # no bubblewrap: the tool runs in the namespace's owner, without capabilities
        bench.policy["sandbox"] = {
            "backends": {"subprocess": {"allow_degraded": True, "bwrap": "/nonexistent"}}
        }
    answer = bench.runner().handle({"toolName": "unplug"})
    assert answer["success"], answer["error"]
    assert answer["metadata"].get("degraded", False) is degraded
    assert answer["result"] == {"tap0": "PermissionError", "lo": "PermissionError"}


def test_slirp4netns_runs_for_the_call_and_is_gone_after_it(bench: ToolBench) -> None:
    bench.tool("nap", SLEEPER, network=True, command=["python3", "main.py", "1"])
    bench.policy["limits"]["network"] = True
    runner = bench.runner()
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.update(p.pid for p in _slirps(os.getpid()))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        answer = runner.handle({"toolName": "nap"})
    finally:
        stop.set()
        sampler.join(5)
    assert answer["success"], answer["error"]
    assert len(seen) == 1, "one slirp4netns, for the call's own namespace"
    assert not any(psutil.pid_exists(pid) for pid in seen)


def test_a_sigkilled_runner_leaves_no_slirp4netns_after_a_second(bench: ToolBench) -> None:
    bench.tool("sleeper", SLEEPER, network=True)
    bench.policy["limits"]["network"] = True
    proc = bench.spawn_runner("sleeper", "req_rootless_net_orphan")
    try:
        wait_for(lambda: bool(_slirps(proc.pid)), timeout_s=30)
        slirp = _slirps(proc.pid)[0]
        wait_for(lambda: psutil.Process(proc.pid).children(recursive=True) != [slirp], timeout_s=30)
        time.sleep(0.3)  # the tool is running
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        while slirp.is_running() and slirp.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - killed_at < GRACE_S, "slirp4netns outlived the runner by a second"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_nothing_survives("req_rootless_net_orphan", grace_s=GRACE_S)


def test_without_a_usable_tun_device_doctor_and_calls_say_so_and_name_the_fix(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    unusable = tmp_path / "tun"
    unusable.write_text("")
    unusable.chmod(0)
    monkeypatch.setattr(_network, "TUN", str(unusable))
    own = next(check for check in _network.network_checks() if check.name == "own network")
    assert not own.ok
    assert own.hint == _network.TUN_HINT
    bench.tool("probe", SLEEPER, network=True)
    bench.policy["limits"]["network"] = True
    answer = bench.runner().handle({"toolName": "probe"})
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "is not usable by uid" in answer["error"]["message"]  # its path is redacted
    assert "chmod 0666" in answer["error"]["message"]


def test_doctor_marks_both_networks_ok_for_this_user() -> None:
    checks = {check.name: check for check in _network.network_checks()}
    for name in ("own network", "egress network"):
        assert checks[name].ok, checks[name]
        assert "user namespace of its own" in checks[name].detail


# Its network namespace's inode, and what it sees of its interfaces.
WHERE = """
import json, os, sys, time
time.sleep(json.load(sys.stdin)["params"].get("hold_s", 0))
interfaces = sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:])
json.dump({"netns": os.stat("/proc/self/ns/net").st_ino, "interfaces": interfaces}, sys.stdout)
"""


def test_pooled_networked_sandboxes_each_get_a_network_of_their_own(bench: ToolBench) -> None:
    bench.tool("where", WHERE, network=True)
    bench.policy["limits"]["network"] = True
    bench.policy["tools"] = {"where": {"pool": 2}}

    async def scenario() -> list[Any]:
        async with bench.runner() as runner:
            await runner.acall("where")  # the pool is filled by now or soon
            # Alive at once (namespace inodes are reused once freed, so only these differ for sure).
            return list(await asyncio.gather(*(runner.acall("where", {"hold_s": 0.5}) for _ in range(2))))

    answers = asyncio.run(scenario())
    assert all(answer.success for answer in answers), answers
    assert all(answer.result["interfaces"] == ["lo", "tap0"] for answer in answers)
    namespaces = {answer.result["netns"] for answer in answers}
    assert len(namespaces) == 2
    assert os.stat("/proc/self/ns/net").st_ino not in namespaces
    assert _slirps(os.getpid()) == []  # the pool's idle sandboxes closed with the runner


def test_a_session_keeps_its_network_between_calls_and_ends_its_slirp4netns(bench: ToolBench) -> None:
    bench.tool("where", WHERE, network=True, session=True)
    bench.policy["limits"]["network"] = True

    async def scenario() -> tuple[list[dict[str, object]], dict[str, object]]:
        async with bench.runner() as runner, runner.session() as session:
            inside = [(await session.acall("where")).result for _ in range(2)]
            outside = (await runner.acall("where")).result  # while the session holds its own
        return inside, outside

    inside, outside = asyncio.run(scenario())
    assert inside[0] == inside[1] and inside[0]["interfaces"] == ["lo", "tap0"]
    assert outside["netns"] != inside[0]["netns"]
    assert _slirps(os.getpid()) == []


def test_a_networked_tool_with_a_write_grant_has_both_its_network_and_staged_writes(
    bench: ToolBench, tmp_path: Path
) -> None:
    # The launcher joins the network's user namespace, then mounts the workspace's overlay
    # in one of its own inside it: both hold together.
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    bench.policy["workspace"] = str(workspace)
    bench.policy["limits"]["network"] = True
    bench.tool(
        "netwriter",
        """
        import json, os, socket, sys
        sys.stdin.read()
        names = sorted(name for _, name in socket.if_nameindex())
        open(os.path.join(os.environ["WORKSPACE"], "out.txt"), "w").write("data")
        print(json.dumps({"interfaces": names}))
        """,
        network=True,
        workspace="write",
    )
    answer = bench.runner().handle({"toolName": "netwriter"})
    assert answer["success"], answer["error"]
    assert answer["result"] == {"interfaces": ["lo", "tap0"]}
    assert (workspace / "out.txt").read_text() == "data"
