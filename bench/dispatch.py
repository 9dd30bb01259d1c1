"""Dispatch on Ray: a trivial tool's latency and throughput on 1 and 2 nodes,
and the dispatch overhead per call against the same call run locally.

Each cluster (head without slots + 1 or 2 worker nodes, 2 ``runner_sandbox`` slots each,
token auth) runs in a loopback-only network namespace (tests/support/ray_agent.py), with the
runner client beside it; the local baseline is measured by that same client in the same
run. All nodes share this machine's cores: on 2 cores, a second node adds slots but no
CPU, so throughput is bounded by the machine (bubblewrap + Python start per call), not by
Ray. Run as root: ``python bench/dispatch.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import yaml
from conftest import BASE_POLICY, write_tool
from support.ray_cluster import RayCluster

TRIVIAL = "import json, sys; json.load(sys.stdin); print('{}')\n"


def summary(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p50 = statistics.median(ordered) * 1000
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1000
    return f"p50 {p50:7.1f} ms  p99 {p99:7.1f} ms"


def measure(nodes: int, calls: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    (work / "cluster").mkdir()
    cluster = RayCluster(work / "cluster", "locked" if nodes == 2 else "locked-1")
    try:
        write_tool(work / "tools", "trivial", TRIVIAL)
        local = yaml.safe_load(yaml.safe_dump(BASE_POLICY))
        (work / "local.yaml").write_text(yaml.safe_dump(local))
        cluster.policy(work / "dispatch.yaml")
        results: dict[str, float] = {}
        for name in ("local", "dispatch"):
            cluster.ask(
                "load", tools=str(work / "tools"), policy=str(work / f"{name}.yaml"), audit="/dev/null"
            )
            # Warm up as wide as the widest run: Ray starts a worker process per concurrent task.
            cluster.ask("bench", tool="trivial", calls=4 * nodes, concurrency=2 * nodes, timeout=300)
            serial = cluster.ask("bench", tool="trivial", calls=calls, concurrency=1, timeout=600)
            assert not serial["failures"], serial["failures"]
            wide = cluster.ask("bench", tool="trivial", calls=calls, concurrency=2 * nodes, timeout=600)
            assert not wide["failures"], wide["failures"]
            throughput = calls / wide["wall"]
            print(
                f"{nodes} node(s) {name:8} one at a time: {summary(serial['latencies'])}; "
                f"{2 * nodes} at once: {throughput:6.1f} calls/s ({summary(wide['latencies'])})"
            )
            results[f"{name}_p50"] = statistics.median(serial["latencies"])
            results[f"{name}_throughput"] = throughput
        return results
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=60)
    calls = parser.parse_args().calls
    one, two = measure(1, calls), measure(2, calls)
    for nodes, r in ((1, one), (2, two)):
        overhead = (r["dispatch_p50"] - r["local_p50"]) * 1000
        print(
            f"{nodes} node(s): dispatch overhead per call {overhead:+.1f} ms at p50 "
            f"({r['dispatch_p50'] / r['local_p50']:.2f}x the local call)"
        )
    print(
        f"throughput 2 nodes / 1 node: {two['dispatch_throughput'] / one['dispatch_throughput']:.2f}x "
        f"(the machine has {__import__('os').cpu_count()} cores, shared by every node)"
    )


if __name__ == "__main__":
    main()
