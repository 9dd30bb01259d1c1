"""The MCP protocol's own cost on a tools/call, over stdio and streamable HTTP, next to
``Runner.acall`` in the same run.

    python3 bench/serve_call.py [--n 50]

Every row calls the shipped add_numbers in the hardened subprocess sandbox. The sandbox
dominates and varies by a few ms between calls, so the protocol's overhead is measured per
call: the client's round trip minus the runner's own duration for that call (which the
server returns in ``_meta["dev.runner/durationMs"]``): JSON-RPC framing, the transport, the
SDK on both ends, the server's handler and the result mapping.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx2  # noqa: E402
from _timing import starter_folder  # noqa: E402
from mcp import Client, StdioServerParameters  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from runner import Runner  # noqa: E402
from runner.mcp.serve.app import DURATION_META  # noqa: E402

STARTER = starter_folder()
POLICY = STARTER / "policies.yaml"
PARAMS = {"a": 1, "b": 2}
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
SERVE = [sys.executable, "-m", "runner", "--policies", str(POLICY), "--audit-log", os.devnull, "serve"]


async def acall_rows(n: int) -> list[float]:
    async with Runner.load(policies=POLICY, audit_log=os.devnull) as runner:
        await runner.acall("add_numbers", PARAMS)
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            await runner.acall("add_numbers", PARAMS)
            samples.append((time.perf_counter() - started) * 1000)
    return samples


async def mcp_rows(client: Client, n: int) -> tuple[list[float], list[float]]:
    """Round trips, and round trips minus the runner's own duration."""
    await client.list_tools()
    await client.call_tool("add_numbers", PARAMS)
    trips, overheads = [], []
    for _ in range(n):
        started = time.perf_counter()
        result = await client.call_tool("add_numbers", PARAMS)
        trip = (time.perf_counter() - started) * 1000
        assert not result.is_error and result.meta is not None
        trips.append(trip)
        overheads.append(trip - result.meta[DURATION_META])
    return trips, overheads


async def over_stdio(n: int) -> tuple[list[float], list[float]]:
    env = {"PYTHONPATH": str(REPO)}
    server = StdioServerParameters(command=SERVE[0], args=[*SERVE[1:], "--stdio"], env=env)
    async with Client(server) as client:
        return await mcp_rows(client, n)


async def over_http(n: int) -> tuple[list[float], list[float]]:
    added = subprocess.run(
        [*SERVE, "tokens", "add", "bench", "--role", "user"],
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    token = added.stdout.strip()
    process = subprocess.Popen([*SERVE, "--http", "127.0.0.1:0"], env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        select.select([process.stderr], [], [], 30)
        url = process.stderr.readline().split("serving MCP at ", 1)[1].strip()
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            httpx2.AsyncClient(headers=headers) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            return await mcp_rows(client, n)
    finally:
        process.terminate()
        process.wait(timeout=30)


def row(name: str, samples: list[float]) -> str:
    p90 = sorted(samples)[max(0, int(len(samples) * 0.9) - 1)]
    return f"{name:<40}{statistics.median(samples):>10.2f}{p90:>9.2f}"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50)
    n = parser.parse_args().n
    acall = await acall_rows(n)
    stdio_trips, stdio_overhead = await over_stdio(n)
    http_trips, http_overhead = await over_http(n)
    print(f"{'what (add_numbers, n=' + str(n) + ')':<40}{'p50 ms':>10}{'p90 ms':>9}")
    print(row("Runner.acall (in process)", acall))
    print(row("tools/call over stdio, round trip", stdio_trips))
    print(row("tools/call over HTTP, round trip", http_trips))
    print(row("stdio: protocol overhead per call", stdio_overhead))
    print(row("HTTP: protocol overhead per call", http_overhead))
    base = statistics.median(acall)
    print(
        f"p50 round trip - p50 acall: stdio {statistics.median(stdio_trips) - base:+.2f} ms,"
        f" HTTP {statistics.median(http_trips) - base:+.2f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())
