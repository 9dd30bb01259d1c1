"""``network: true`` is never the host's network (SPEC 4, 5): hostile tools, real sandboxes.

Every server here is started by the test on the host's loopback (or as an abstract unix
socket of the host's network namespace); nothing else is ever contacted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench

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
