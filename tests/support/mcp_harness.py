"""The real server process and the SDK's real client, for the ``runner serve`` tests."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import yaml
from conftest import ToolBench
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
# Sleeps for params.seconds (default 60), then answers {"slept": seconds}.
SLEEPER = """
import json, sys, time
seconds = json.load(sys.stdin)["params"].get("seconds", 60)
time.sleep(seconds)
json.dump({"slept": seconds}, sys.stdout)
"""
OBJECT_OUT = {"type": "object", "properties": {"slept": {"type": "number"}}, "required": ["slept"]}
SLOW = {"timeout_ms": 30000}


def write_policy(bench: ToolBench) -> None:
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))


def server_argv(bench: ToolBench, *args: str) -> list[str]:
    """``runner serve ...`` over the bench's tools, policy and audit log."""
    write_policy(bench)
    return [
        sys.executable,
        "-m",
        "runner",
        "--tools",
        str(bench.tools),
        "--policies",
        str(bench.root / "policies.yaml"),
        "--audit-log",
        str(bench.audit_log),
        "serve",
        *args,
    ]


def stdio_server(bench: ToolBench, *args: str, exit_file: Path | None = None) -> StdioServerParameters:
    """The server as an MCP client spawns it; with ``exit_file``, through a shell that
    writes the server's exit status there."""
    argv = server_argv(bench, "--stdio", *args)
    if exit_file is not None:
        argv = ["sh", "-c", '"$@"; echo $? > "$0"', str(exit_file), *argv]
    # The SDK gives the server only an allow-listed environment: PYTHONPATH (set by
    # conftest) makes it import the package under test.
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]}
    return StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(bench.root), env=env)


def server_pid(bench: ToolBench) -> int:
    """The pid of the ``runner serve`` process over this bench (a child of the tests)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if cmdline[:3] == [sys.executable, "-m", "runner"] and str(bench.tools) in cmdline:
            return child.pid
    raise AssertionError("no runner serve process found")


def audit_events(bench: ToolBench, **match: Any) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [e for e in events if all(e.get(k) == v for k, v in match.items())]


class HttpServer:
    """``runner serve --http 127.0.0.1:0 ARGS`` in a process of its own; ``url`` (and
    ``metrics_url`` with ``--metrics``) once it listens. ``soft_nofile``: the server starts
    with that soft RLIMIT_NOFILE (systemd's default is 1024)."""

    def __init__(self, bench: ToolBench, *args: str, soft_nofile: int | None = None) -> None:
        # Unbuffered: a text stream's readline may take several lines into its own buffer,
        # and select on the pipe then waits for more while the lines wait there.
        self.process = subprocess.Popen(
            server_argv(bench, "--http", "127.0.0.1:0", *args),
            stderr=subprocess.PIPE,
            bufsize=0,
            preexec_fn=None if soft_nofile is None else _soft_nofile(soft_nofile),  # noqa: PLW1509 - setrlimit only
        )
        assert self.process.stderr is not None
        self.stderr: list[str] = []
        urls: dict[str, str] = {}
        wanted = {"MCP", "metrics"} if "--metrics" in args else {"MCP"}
        pending = b""
        try:
            while set(urls) != wanted:
                if b"\n" not in pending:
                    ready, _, _ = select.select([self.process.stderr], [], [], 30)
                    assert ready, f"the server did not start: {self.stderr}"
                    chunk = os.read(self.process.stderr.fileno(), 65536)
                    assert chunk, f"the server exited: {self.stderr}"
                    pending += chunk
                    continue
                raw, pending = pending.split(b"\n", 1)
                line = raw.decode() + "\n"
                self.stderr.append(line)
                for what in wanted:
                    if f"serving {what} at " in line:
                        urls[what] = line.split(" at ", 1)[1].strip()
        except BaseException:
            self.process.kill()  # a server that did not start leaves no process or pipe
            self.stop()
            raise
        if pending:
            self.stderr.append(pending.decode(errors="replace"))
        self.url = urls["MCP"]
        self.metrics_url = urls.get("metrics", "")

    @contextlib.asynccontextmanager
    async def client(self, token: str | None, **options: Any) -> AsyncIterator[Client]:
        """The SDK's client with ``token``; its HTTP client is closed with it (the SDK
        leaves a client it was given open)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60.0)) as http,
            Client(streamable_http_client(self.url, http_client=http), **options) as client,
        ):
            yield client

    def stop(self) -> int:
        """SIGTERM, then the exit status (and the rest of stderr in ``stderr``)."""
        if self.process.poll() is None:
            self.process.terminate()
        status = self.process.wait(timeout=30)
        assert self.process.stderr is not None
        if not self.process.stderr.closed:
            self.stderr.append(self.process.stderr.read().decode(errors="replace"))
            self.process.stderr.close()
        return status


def _soft_nofile(soft: int) -> Callable[[], None]:
    def lower() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return lower


def add_token(bench: ToolBench, name: str, role: str) -> str:
    """A token added with ``runner serve tokens add`` (the real command)."""
    write_policy(bench)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "--policies",
            str(bench.root / "policies.yaml"),
            "serve",
            "tokens",
            "add",
            name,
            "--role",
            role,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    bench.policy = yaml.safe_load((bench.root / "policies.yaml").read_text())
    return done.stdout.strip()
