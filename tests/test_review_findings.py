"""Holes found by the hostile review of the secrets, egress, serve and tool-error changes.

Each test is a hostile tool or client against real sandboxes; every server is the test's
own, on the host's loopback.
"""

from __future__ import annotations

import os
import threading
import time

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
            {"toolName": "hoard", "params": {"count": 600, "hold_s": 1.5}, "options": {"timeout": 20000, "deadline": 20000, "retries": 0}}
        )
    finally:
        stop.set()
        sampler.join()
    assert answer["success"], answer["error"]
    assert peak[0] - baseline < 200, f"the runner held {peak[0] - baseline} more descriptors during the call"
