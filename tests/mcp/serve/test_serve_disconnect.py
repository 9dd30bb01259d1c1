"""``runner serve --http``: a client that drops its connection cancels its call (its sandbox
is killed, its slot freed, its ``call.finished`` says ``cancelled``). The client is the
SDK's, in a process of its own that is killed with SIGKILL mid-call: the kernel closes its
sockets, and nothing (no DELETE of the session, no ``notifications/cancelled``) is sent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import ToolBench, wait_for
from support.mcp_harness import OBJECT_OUT, SLEEPER, SLOW, HttpServer, add_token, audit_events

from sandboxes.testing import processes_with_env

pytestmark = pytest.mark.anyio

# The client process: it opens a session and starts a 60 s call, then waits to be killed.
CLIENT = """
import sys, anyio, httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

url, token, mode, request_id = sys.argv[1:5]

async def main() -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await client.call_tool("sleeper", {"seconds": 60}, meta={"dev.runner/requestId": request_id})

anyio.run(main)
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def served(bench: ToolBench) -> Iterator[tuple[HttpServer, str]]:
    bench.tool("sleeper", SLEEPER, output_schema=OBJECT_OUT, limits=SLOW)
    bench.policy["roles"] = {"admin": {"allow": ["*"]}}
    bench.policy["default_role"] = "admin"
    bench.policy["serve"] = {"max_concurrent": 1}
    token = add_token(bench, "ops", "admin")
    server = HttpServer(bench)
    yield server, token
    assert server.stop() == 0


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_client_that_drops_its_connection_mid_call_has_its_sandbox_killed_and_its_slot_freed(
    bench: ToolBench, served: tuple[HttpServer, str], mode: str
) -> None:
    server, token = served
    request_id = f"req_dropped_{mode}"
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.url, token, mode, request_id],
        env={**os.environ},
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: processes_with_env(f"REQUEST_ID={request_id}") != [], 30.0)
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
    dropped = time.monotonic()
    marker = f"REQUEST_ID={request_id}"
    while processes_with_env(marker) and time.monotonic() - dropped < 3.0:
        time.sleep(0.05)
    gone_after = time.monotonic() - dropped
    assert processes_with_env(marker) == [], f"the sandbox outlived its client by {gone_after:.1f} s"
    # serve.max_concurrent is 1: the next call gets the slot at once.
    async with server.client(token, mode=mode) as other:
        started = time.monotonic()
        result = await other.call_tool("sleeper", {"seconds": 0})
        waited = time.monotonic() - started
    assert not result.is_error and result.structured_content == {"slept": 0}
    assert waited < 10.0
    wait_for(lambda: audit_events(bench, event="call.finished", requestId=request_id) != [], 5.0)
    [finished] = audit_events(bench, event="call.finished", requestId=request_id)
    assert finished["cancelled"] is True
