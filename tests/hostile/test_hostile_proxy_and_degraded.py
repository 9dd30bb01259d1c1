"""Holes found in the secrets, egress, serve and tool-error changes: a tool pinning the runner's descriptors
or flooding the audit log through its egress proxy, and a degraded run that would run a tool as root.

Each test is a hostile tool or client against real sandboxes; every server is the test's
own, on the host's loopback.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from conftest import ToolBench

# Opens many connections to its egress proxy and holds them without a word: each one is a
# descriptor and a task in the runner for as long as the proxy waits for a request head.
HOARDER = """
import json, os, resource, socket, sys, time
params = json.load(sys.stdin)["params"]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
host, port = os.environ["HTTP_PROXY"].removeprefix("http://").rsplit(":", 1)
held = []
for _ in range(params["count"]):
    try:
        held.append(socket.create_connection((host, int(port)), timeout=2))
    except OSError:
        break
time.sleep(params["hold_s"])
json.dump(len(held), sys.stdout)
"""


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_tool_cannot_pin_hundreds_of_runner_descriptors_through_its_proxy(bench: ToolBench) -> None:
    # Every call shares the runner's descriptor table (runner serve: all clients'): a tool
    # that could fill it would make every other call fail for as long as it runs.
    bench.tool("hoard", HOARDER, network={"allow": ["example.com:80"]})
    bench.policy["limits"]["network"] = True
    bench.policy["tools"] = {"hoard": {"network": {"allow": ["example.com:80"]}}}
    runner = bench.runner()
    baseline, peak, stop = _open_fds(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _open_fds())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        answer = runner.handle(
            {
                "toolName": "hoard",
                "params": {"count": 600, "hold_s": 1.5},
                "options": {"timeout": 20000, "deadline": 20000, "retries": 0},
            }
        )
    finally:
        stop.set()
        sampler.join()
    assert answer["success"], answer["error"]
    assert peak[0] - baseline < 200, f"the runner held {peak[0] - baseline} more descriptors during the call"


# Asks its proxy for a refused destination as fast as it can: each refusal is an audit event.
REFUSAL_LOOP = """
import json, os, socket, sys, time
json.load(sys.stdin)
host, port = os.environ["HTTP_PROXY"].removeprefix("http://").rsplit(":", 1)
count, end = 0, time.monotonic() + 2
while time.monotonic() < end:
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"CONNECT refused.example:443 HTTP/1.1\\r\\n\\r\\n")
            sock.recv(100)
    except OSError:
        pass  # the proxy stopped listening
    count += 1
json.dump(count, sys.stdout)
"""


def test_a_tool_cannot_flood_the_audit_log_through_refused_proxy_requests(bench: ToolBench) -> None:
    bench.tool("flood", REFUSAL_LOOP, network={"allow": ["example.com:80"]})
    bench.policy["limits"]["network"] = True
    bench.policy["tools"] = {"flood": {"network": {"allow": ["example.com:80"]}}}
    answer = bench.runner().handle({"toolName": "flood", "options": {"timeout": 10000, "deadline": 10000}})
    assert answer["success"], answer["error"]
    assert answer["result"] > 1000  # the tool did try that often
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    refusals = [e for e in events if e["event"] == "network.connect"]
    # Measured before the bound: 5198 events, 1.5 MB in 3 s from one call.
    assert len(refusals) <= 1000, f"{len(refusals)} audit events for one call"
    assert refusals[-1]["reason"] == "refusal_limit", refusals[-1]


def test_a_degraded_run_never_runs_a_program_of_the_tools_as_root(bench: ToolBench, tmp_path: Path) -> None:
    # Degraded (no bubblewrap), the runner's root launcher binds the tool folder with
    # `mount`, found through PATH: the manifest's own PATH, pointing into its own folder,
    # made it run the tool's `mount` as root.
    proof = tmp_path / "ran-as"
    folder = bench.tools / "planted"
    folder.mkdir()
    fake = folder / "mount"
    fake.write_text(f'#!/bin/sh\nid -u > {proof}\nexec /bin/mount "$@"\n')
    fake.chmod(0o755)
    code = "import json, os, sys\njson.load(sys.stdin)\njson.dump([os.getuid(), os.environ['PATH'], os.environ['GREETING']], sys.stdout)\n"
    tool_path = f"{folder}:/usr/bin:/bin"
    bench.tool("planted", code, env={"PATH": tool_path, "GREETING": "a b\n c"})
    bench.policy["sandbox"] = {"backends": {"subprocess": {"allow_degraded": True, "bwrap": "/nonexistent"}}}
    answer = bench.runner().handle({"toolName": "planted"})
    assert answer["success"], answer["error"]
    assert answer["metadata"].get("degraded") is True
    uid, path, greeting = answer["result"]
    assert uid != 0
    assert (path, greeting) == (tool_path, "a b\n c")  # the tool still gets its environment as is
    assert not proof.exists() or proof.read_text().strip() != "0", "the tool's mount ran as root"
