"""``network: true`` is never the host's network: hostile tools, real sandboxes.

Every server here is started by the test on the host's loopback (or as an abstract unix
socket of the host's network namespace); nothing else is ever contacted.
"""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench
from docker import APIClient

from runner.call.egress import EgressBounds
from sandboxes.docker._container import tool_network

PROBE = """
import json, os, socket, sys
params = json.load(sys.stdin)["params"]
result = {}
for target in params["targets"]:
    try:
        if target.startswith("@"):  # an abstract unix socket
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(2)
            sock.connect("\\0" + target[1:])
        else:
            host, port = target.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=2)
        result[target] = sock.recv(16).decode() or "connected"
        sock.close()
    except OSError as exc:
        result[target] = type(exc).__name__
result["interfaces"] = sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:])
json.dump(result, sys.stdout)
"""


class Greeter:
    """A server the tests start on the host: it greets whoever connects, and counts them."""

    def __init__(self, server: socket.socket) -> None:
        self.server = server
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.sendall(b"hello")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self.server.close()
        self._thread.join(5)


@pytest.fixture
def loopback_server() -> Iterator[Greeter]:
    greeter = Greeter(socket.create_server(("127.0.0.1", 0)))
    yield greeter
    greeter.close()


@pytest.fixture
def abstract_server() -> Iterator[tuple[str, Greeter]]:
    name = f"runner-test-{os.getpid()}-{id(object())}"
    server = socket.socket(socket.AF_UNIX)
    server.bind("\0" + name)
    server.listen()
    greeter = Greeter(server)
    yield name, greeter
    greeter.close()


def probe(bench: ToolBench, targets: list[str], **manifest: Any) -> dict[str, Any]:
    bench.tool("probe", PROBE, network=True, **manifest)
    bench.policy["limits"]["network"] = True
    answer = bench.runner().handle({"toolName": "probe", "params": {"targets": targets}})
    assert answer["success"], answer["error"]
    result: dict[str, Any] = answer["result"]
    return result


def test_a_networked_tool_cannot_reach_the_hosts_loopback(
    bench: ToolBench, loopback_server: Greeter, abstract_server: tuple[str, Greeter]
) -> None:
    port = loopback_server.server.getsockname()[1]
    name, abstract = abstract_server
    # 10.0.2.2 is slirp4netns's gateway, which would map to the host's 127.0.0.1.
    targets = [f"127.0.0.1:{port}", f"10.0.2.2:{port}", f"@{name}"]
    result = probe(bench, targets)
    for target in targets:
        assert result[target] != "hello", target
    assert loopback_server.connections == 0
    assert abstract.connections == 0
    assert result["interfaces"] == ["lo", "tap0"]  # a network of its own, not none at all


def test_without_user_mode_networking_a_networked_tool_is_refused(
    bench: ToolBench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loopback_server: Greeter
) -> None:
    # A PATH with everything the sandbox needs but slirp4netns.
    tools = tmp_path / "bin"
    tools.mkdir()
    for program in ("bwrap", "setpriv", "unshare", "nsenter", "python3"):
        found = shutil.which(program)
        assert found is not None, program
        (tools / program).symlink_to(found)
    monkeypatch.setenv("PATH", str(tools))
    bench.tool("probe", PROBE, network=True)
    bench.policy["limits"]["network"] = True
    port = loopback_server.server.getsockname()[1]
    answer = bench.runner().handle({"toolName": "probe", "params": {"targets": [f"127.0.0.1:{port}"]}})
    assert answer["success"] is False
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert loopback_server.connections == 0


# -- allow-lists: loopback only, plus the runner's egress proxy --------------------------

EGRESS_PROBE = """
import json, os, socket, sys, urllib.error, urllib.request
params = json.load(sys.stdin)["params"]
proxy = os.environ["HTTP_PROXY"].removeprefix("http://")
host, port = proxy.rsplit(":", 1)
result = []
for kind, target in params["tries"]:
    try:
        if kind == "http":
            with urllib.request.urlopen(target, timeout=5) as answer:
                result.append(answer.read().decode())
        elif kind == "connect":
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n".encode())
            answer = b""
            while b"\\r\\n\\r\\n" not in answer and (chunk := sock.recv(1024)):
                answer += chunk
            head, _, rest = answer.partition(b"\\r\\n\\r\\n")
            code = head.split(b" ")[1].decode()
            result.append(f"200 {(rest or sock.recv(16)).decode()}" if code == "200" else code)
        else:
            name, number = target.rsplit(":", 1)
            result.append(socket.create_connection((name, int(number)), timeout=2).recv(16).decode())
    except urllib.error.HTTPError as exc:
        result.append(str(exc.code))
    except OSError as exc:
        result.append(type(exc).__name__)
json.dump(result, sys.stdout)
"""
BACKENDS = ["subprocess", pytest.param("docker", marks=pytest.mark.docker)]


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"page")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def egress_call(
    bench: ToolBench,
    backend: str,
    request: pytest.FixtureRequest,
    tries: list[tuple[str, str]],
    manifest_allow: list[str],
    policy_allow: list[str] | None = None,
) -> tuple[list[str], list[dict[str, Any]]]:
    """The tool's view of each try, and the call's ``network.connect`` events."""
    extra: dict[str, Any] = {}
    if backend == "docker":
        request.getfixturevalue("docker_client")
        extra = {"sandbox": "docker", "image": "runner/base:latest"}
    bench.tool("fetch", EGRESS_PROBE, network={"allow": manifest_allow}, **extra)
    bench.policy["limits"]["network"] = True
    bench.policy["tools"] = {"fetch": {"network": {"allow": policy_allow or manifest_allow}}}
    answer = bench.runner().handle({"toolName": "fetch", "params": {"tries": tries}})
    assert answer["success"], answer["error"]
    request_id = answer["metadata"]["requestId"]
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    connects = [e for e in events if e["event"] == "network.connect" and e["requestId"] == request_id]
    return answer["result"], connects


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_listed_loopback_server_is_reached_through_the_proxy_and_never_directly(
    bench: ToolBench,
    backend: str,
    request: pytest.FixtureRequest,
    web_server: http.server.ThreadingHTTPServer,
    loopback_server: Greeter,
) -> None:
    web = f"127.0.0.1:{web_server.server_address[1]}"
    greeter = f"127.0.0.1:{loopback_server.server.getsockname()[1]}"
    tries = [("http", f"http://{web}/"), ("connect", greeter), ("direct", greeter)]
    result, connects = egress_call(bench, backend, request, tries, [web, greeter])
    assert result[:2] == ["page", "200 hello"]
    assert result[2] != "hello"  # the proxy is its only way out
    assert loopback_server.connections == 1
    opened = [(e["decision"], e["method"], f"{e['host']}:{e['port']}", e["address"]) for e in connects]
    assert opened == [("allow", "GET", web, "127.0.0.1"), ("allow", "CONNECT", greeter, "127.0.0.1")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unlisted_ports_and_names_that_resolve_to_loopback_are_refused_and_audited(
    bench: ToolBench,
    backend: str,
    request: pytest.FixtureRequest,
    web_server: http.server.ThreadingHTTPServer,
    loopback_server: Greeter,
) -> None:
    web_port = web_server.server_address[1]
    port = loopback_server.server.getsockname()[1]
    manifest = [f"127.0.0.1:{web_port}", f"localhost:{port}", f"127.0.0.1:{port}"]
    policy = [f"127.0.0.1:{web_port}", f"localhost:{port}"]  # the literal address not granted
    tries = [
        ("connect", f"127.0.0.1:{port}"),  # in the manifest only
        ("connect", f"localhost:{port}"),  # in both lists, but localhost is 127.0.0.1
        ("http", "http://127.0.0.1:9/"),  # a port in neither list
        ("http", f"http://localhost:{web_port}/"),  # an unlisted name for a listed address
    ]
    result, connects = egress_call(bench, backend, request, tries, manifest, policy)
    assert result == ["403"] * 4
    assert loopback_server.connections == 0
    refused = [(e["decision"], e["reason"], e["host"]) for e in connects]
    assert refused == [
        ("deny", "not_allowed", "127.0.0.1"),
        ("deny", "private_address", "localhost"),
        ("deny", "not_allowed", "127.0.0.1"),
        ("deny", "not_allowed", "localhost"),
    ]


def test_an_allow_list_the_policy_does_not_grant_is_permission_denied(bench: ToolBench) -> None:
    bench.tool("fetch", EGRESS_PROBE, network={"allow": ["api.example.com:443"]})
    bench.policy["limits"]["network"] = True
    answer = bench.runner().handle({"toolName": "fetch", "params": {"tries": []}})
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert answer["error"]["details"]["reason"] == "network"


def test_the_proxy_opens_at_most_its_bound_of_connections_per_call(
    bench: ToolBench, request: pytest.FixtureRequest, loopback_server: Greeter
) -> None:
    greeter = f"127.0.0.1:{loopback_server.server.getsockname()[1]}"
    bound = EgressBounds().max_connections
    result, connects = egress_call(
        bench, "subprocess", request, [("connect", greeter)] * (bound + 2), [greeter]
    )
    assert result == ["200 hello"] * bound + ["403", "403"]
    assert loopback_server.connections == bound
    assert [e["reason"] for e in connects[bound:]] == ["connection_limit"] * 2


# -- docker's network: true is its default bridge ----------------------------------------


@pytest.mark.docker
def test_a_bridged_container_reaches_the_gateway_but_not_the_hosts_loopback(
    bench: ToolBench, docker_client: APIClient, loopback_server: Greeter
) -> None:
    config = docker_client.inspect_network(tool_network(docker_client))["IPAM"]["Config"][0]
    gateway = config.get("Gateway") or str(next(ipaddress.ip_network(config["Subnet"]).hosts()))
    exposed = Greeter(socket.create_server((gateway, 0)))  # a host service bound to the gateway
    try:
        port = loopback_server.server.getsockname()[1]
        exposed_port = exposed.server.getsockname()[1]
        targets = [f"127.0.0.1:{port}", f"{gateway}:{port}", f"{gateway}:{exposed_port}"]
        result = probe(bench, targets, sandbox="docker", image="runner/base:latest")
    finally:
        exposed.close()
    assert result[f"127.0.0.1:{port}"] != "hello"  # the container's own loopback
    assert result[f"{gateway}:{port}"] != "hello"  # the host's loopback is not behind the gateway
    assert loopback_server.connections == 0
    # What the README states: services the host binds to the gateway (or 0.0.0.0) are reachable.
    assert result[f"{gateway}:{exposed_port}"] == "hello"


LISTENER = """
import json, socket, sys
sys.stdin.read()
server = socket.create_server(("0.0.0.0", 8080))
server.settimeout(8)  # for each connection: the host's, then (it must not come) the probe's
peers = []
try:
    while len(peers) < 2:
        conn, peer = server.accept()
        peers.append(peer[0])
        conn.sendall(b"hello")
        conn.close()
except TimeoutError:
    pass
print(json.dumps({"peers": peers}))
"""


def test_networked_containers_cannot_reach_each_other(bench: ToolBench, docker_client: APIClient) -> None:
    # On Docker's default bridge one call reached another's listener (or a session's).
    bench.tool("listener", LISTENER, network=True, sandbox="docker", image="runner/base:latest")
    bench.policy["limits"]["network"] = True
    bench.policy["defaults"]["deadline_ms"] = 60000
    runner = bench.runner()
    answers: list[dict[str, Any]] = []
    request = {"toolName": "listener", "requestId": "req_listener", "options": {"timeout": 30000}}
    serving = threading.Thread(target=lambda: answers.append(runner.handle(request)))
    serving.start()
    address = ""
    for _ in range(300):
        found = docker_client.containers(filters={"label": "io.runner.request-id=req_listener"})
        if found:
            networks = docker_client.inspect_container(found[0]["Id"])["NetworkSettings"]["Networks"]
            address = networks.get(tool_network(docker_client), {}).get("IPAddress", "")
        if address:
            break
        threading.Event().wait(0.1)
    assert address, "the listener's container never got an address on the tools' network"
    target = f"{address}:8080"
    for _ in range(100):  # until it listens: the host reaches it, so the probe's miss means something
        with contextlib.suppress(OSError), socket.create_connection((address, 8080), timeout=2) as conn:
            assert conn.recv(5) == b"hello"
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail("the host never reached the listener")
    result = probe(bench, [target], sandbox="docker", image="runner/base:latest")
    serving.join(60)
    assert result[target] != "hello"
    assert answers and answers[0]["success"], answers
    assert len(answers[0]["result"]["peers"]) == 1  # the host's connection alone


def _remove_tools_networks(client: APIClient) -> None:
    """Once the last call's container is gone (it is removed after the answer)."""
    from docker.errors import APIError

    for _ in range(300):
        try:
            for network in client.networks(filters={"label": "io.runner.tools-network=true"}):
                client.remove_network(network["Id"])
            return
        except APIError:
            threading.Event().wait(0.1)
    pytest.fail("the tools' network kept an endpoint for 30 s")


RACER = """
import sys
from sandboxes.docker._client import api_client
from sandboxes.docker._container import tool_network
sys.stdin.read()  # all start, then all ask at once
print(tool_network(api_client()))
"""


@pytest.mark.docker
def test_the_tools_network_is_made_again_once_and_agreed_on_by_runners_making_it_at_once(
    bench: ToolBench, docker_client: APIClient
) -> None:
    # Removed under a running runner, it was gone for good (the runner had cached it); made
    # by four runners at once, the daemon made four of one name, and every call failed.
    bench.tool("probe", PROBE, network=True, sandbox="docker", image="runner/base:latest")
    bench.policy["limits"]["network"] = True
    runner = bench.runner()
    call = {"toolName": "probe", "params": {"targets": []}}
    assert runner.handle(call)["success"]
    _remove_tools_networks(docker_client)
    assert runner.handle(call)["success"], "the network was not made again"
    _remove_tools_networks(docker_client)
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    for racer in racers:
        assert racer.stdin is not None
        racer.stdin.close()
    answers = []
    for racer in racers:
        assert racer.stdout is not None
        with racer.stdout:
            answers.append(racer.stdout.read().strip())
        racer.wait(120)
    # A racer that looked before another's network showed takes its own: each is cut off
    # alike, and of a name of its own (networks of one name, which the daemon then could
    # not tell apart, failed every later call).
    made = {n["Name"]: n for n in docker_client.networks(filters={"label": "io.runner.tools-network=true"})}
    assert all(answers) and set(answers) <= set(made), (answers, list(made))
    assert all(made[name]["Options"]["com.docker.network.bridge.enable_icc"] == "false" for name in answers)
    assert runner.handle(call)["success"]
    assert tool_network(docker_client) == min(made.values(), key=lambda n: str(n["Id"]))["Name"]
    runner.close()
    _remove_tools_networks(docker_client)  # the racers' extra ones too
