"""A hosted MCP server's call, cold and warm, next to the same server called
directly over stdio in the same run.

    python3 bench/hosted_call.py [--n 30] [--folder DIR] [--paired-only]

The server is ``mcp-server-time`` from PyPI, installed with ``runner mcp add time --pip
mcp-server-time`` into a scratch tool folder (``--folder`` reuses one made before; the
install itself is not timed). The call is ``get_current_time`` for UTC. Rows:

- ``long-lived server`` (the floor): one server process started once, each call a
  ``tools/call`` on the same session, as gateways that keep a server per client do; no
  isolation between calls at all.
- ``fresh server, no sandbox``: a new process per call (start, ``initialize``, one call,
  stop) with the SDK's stdio client: what fresh state per call costs without a sandbox.
- ``Runner.call cold``: a fresh sandbox per call, the server started in it.
- ``Runner.call warm``: ``tools.time_get_current_time.pool: 1``: the sandbox and the
  server started and initialized ahead (a pooled sandbox counts as ready only once its
  server answered ``initialize``); each call waits, untimed, until the pool is full
  again, and says only ``tools/call``.
- ``Session.acall``: ``tools.time_get_current_time.session: true``: in a session of the
  Python API, the server is started and initialized in its sandbox by a first, untimed
  call; each call is one ``tools/call`` in that server's conversation. The target: at
  most twice the long-lived row.

The long-lived and session rows are sampled in turns on one event loop (a call of each
per round), so that a machine that slows down or speeds up weighs on both alike; the
other rows are measured one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import print_table, starter_folder, timed  # noqa: E402

from runner import Runner  # noqa: E402

if TYPE_CHECKING:
    from mcp import StdioServerParameters

TOOL = "time_get_current_time"
ARGS = {"timezone": "UTC"}


def install(root: Path) -> Path:
    folder = root / "tools" / "time"
    if not folder.exists():
        argv = [
            sys.executable,
            "-m",
            "runner",
            "--tools",
            str(root / "tools"),
            "--policies",
            str(root / "policies.yaml"),
            "mcp",
            "add",
            "time",
            "--pip",
            "mcp-server-time",
        ]
        subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return folder


def policy(root: Path, pool: int, session: bool = False) -> Path:
    document = yaml.safe_load((root / "policies.yaml").read_text())
    document["whitelist"] = ["*"]
    document.setdefault("roles", {}).setdefault(document["default_role"], {})["allow"] = ["*"]
    document["tools"] = {TOOL: {"pool": pool}} if pool else {}
    if session:
        document["tools"][TOOL] = {"session": True}
    path = root / f"policies-hosted-{pool}{'-session' if session else ''}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _server(folder: Path) -> StdioServerParameters:
    from mcp import StdioServerParameters

    return StdioServerParameters(
        command=str(folder / "venv" / "bin" / "python3"), args=["-m", "mcp_server_time"], cwd=str(folder)
    )


def fresh_rows(folder: Path, n: int) -> list[float]:
    from mcp import ClientSession
    from mcp.client.stdio import stdio_client

    server = _server(folder)

    async def fresh() -> list[float]:
        samples = []
        for _ in range(n + 1):
            started = time.perf_counter()
            async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                await session.call_tool("get_current_time", ARGS)
            samples.append((time.perf_counter() - started) * 1000)
        return samples[1:]

    return anyio.run(fresh)


def runner_rows(root: Path, n: int) -> tuple[list[float], list[float], int]:
    audit = root / "audit.log"
    written_before = audit.stat().st_size if audit.exists() else 0  # a --folder's earlier runs
    with Runner.load(
        tools=root / "tools", policies=policy(root, 0), audit_log=audit, warm_pools=False
    ) as cold:
        cold_samples = timed(lambda: _ok(cold.call(TOOL, ARGS)), n)
    warm_samples = []
    warm_used = 0
    with Runner.load(tools=root / "tools", policies=policy(root, 1), audit_log=audit) as warm:
        for _ in range(n + 1):
            _wait_full(warm)
            started = time.perf_counter()
            answer = warm.call(TOOL, ARGS)
            warm_samples.append((time.perf_counter() - started) * 1000)
            _ok(answer)
    events = [json.loads(line) for line in audit.read_bytes()[written_before:].splitlines()]
    warm_used = sum(1 for e in events if e["event"] == "call.attempt" and e.get("warm"))
    return cold_samples, warm_samples[1:], warm_used


def paired_rows(root: Path, folder: Path, n: int) -> tuple[list[float], list[float]]:
    """The long-lived server's own call and a call in a session, in turns on one loop."""
    from mcp import ClientSession
    from mcp.client.stdio import stdio_client

    runner = Runner.load(
        tools=root / "tools",
        policies=policy(root, 0, session=True),
        audit_log=root / "audit.log",
        warm_pools=False,
    )

    async def turns() -> tuple[list[float], list[float]]:
        direct_samples: list[float] = []
        session_samples: list[float] = []
        async with stdio_client(_server(folder)) as (read, write), ClientSession(read, write) as direct:
            await direct.initialize()
            async with runner.session() as session:
                for _ in range(n + 1):
                    started = time.perf_counter()
                    await direct.call_tool("get_current_time", ARGS)
                    direct_samples.append((time.perf_counter() - started) * 1000)
                    started = time.perf_counter()
                    _ok(await session.acall(TOOL, ARGS))
                    session_samples.append((time.perf_counter() - started) * 1000)
        await runner.aclose()
        return direct_samples[1:], session_samples[1:]  # the first: the session's server starts

    return asyncio.run(turns())


def _wait_full(r: Runner) -> None:
    deadline = time.monotonic() + 30
    while r.warm_sandboxes().get(TOOL, 0) < 1:
        if time.monotonic() > deadline:
            raise SystemExit("the pool did not fill within 30 s")
        time.sleep(0.005)


def _ok(answer: object) -> None:
    if not getattr(answer, "success", False):
        raise SystemExit(f"the call failed: {answer}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--folder", type=Path, help="a folder from an earlier run (tools/time installed)")
    parser.add_argument(
        "--paired-only", action="store_true", help="only the long-lived and session rows, in turns"
    )
    args = parser.parse_args()
    root = args.folder or Path(tempfile.mkdtemp(prefix="runner-hosted-bench-"))
    if not (root / "policies.yaml").exists():
        root = starter_folder() if args.folder is None else root
    folder = install(root)
    print(f"mcp-server-time in {folder}; {args.n} calls per row, {os.cpu_count()} cores")
    long_lived, in_session = paired_rows(root, folder, args.n)
    if args.paired_only:
        print_table([("long-lived server", long_lived), ("Session.acall", in_session)], "long-lived")
        return
    fresh = fresh_rows(folder, args.n)
    cold, warm, warm_used = runner_rows(root, args.n)
    print_table(
        [
            ("long-lived server", long_lived),
            ("fresh server, no sandbox", fresh),
            ("Runner.call cold", cold),
            ("Runner.call warm", warm),
            ("Session.acall", in_session),
        ],
        "long-lived",
    )
    print(f"warm calls that found a warm sandbox: {warm_used} of {args.n + 1}")


if __name__ == "__main__":
    main()
