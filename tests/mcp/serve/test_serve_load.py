"""Load through ``runner serve --http`` beside a connection flood: 1000 calls at concurrency
64 from two SDK clients (two tokens) to a pooled tool, while ``nobody`` holds 1100 idle
connections against each listener from another address (127.0.0.2), which the per-peer
cap keeps to its share. Every answer is right, and nothing is left behind. (From the
clients' own address a flood can reset a client's new connection before its request
arrives, as docs/serve.md says: test_serve_flood.py covers that case.)"""

from __future__ import annotations

import json
import time
import uuid

import anyio
import mcp_types as types
import pytest
from conftest import ToolBench, wait_for
from mcp import Client
from support.flood_harness import Flood, Usage, port_of
from support.mcp_harness import ECHO, HttpServer, add_token, audit_events

from sandboxes.testing import processes_with_env

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CALLS = 1000
CONCURRENCY = 64
# Generous, for a loaded 2-core machine; docs/performance.md has the measured times.
WITHIN_S = 240.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_thousand_calls_at_concurrency_64_beside_a_flood_are_all_answered_and_leave_nothing(
    bench: ToolBench,
) -> None:
    mark = uuid.uuid4().hex
    bench.tool("echo", ECHO, env={"LOAD_MARK": mark})
    bench.policy["roles"] = {"user": {"allow": ["echo"]}}
    bench.policy["tools"] = {"echo": {"pool": 8}}
    bench.policy["serve"] = {"max_concurrent": 16}
    tokens = [add_token(bench, "first", "user"), add_token(bench, "second", "user")]
    server = HttpServer(bench, "--metrics", "127.0.0.1:0", soft_nofile=1024)
    usage = Usage(server.process.pid)
    answers: dict[int, object] = {}
    wrong: list[tuple[int, str]] = []
    numbers = iter(range(CALLS))

    async def worker(client: Client) -> None:
        for n in numbers:
            result = await client.call_tool("echo", {"n": n})
            text = result.content[0].text if isinstance(result.content[0], types.TextContent) else ""
            if result.is_error or json.loads(text) != {"n": n}:
                wrong.append((n, text[:200]))
            answers[n] = text

    try:
        flood = Flood([port_of(server.url), port_of(server.metrics_url)], source="127.0.0.2")
        try:
            flood.wait_holding(ticks=2)
            started = time.monotonic()
            with anyio.fail_after(WITHIN_S):
                async with (
                    server.client(tokens[0]) as first,
                    server.client(tokens[1], mode="legacy") as second,
                    anyio.create_task_group() as tasks,
                ):
                    for index in range(CONCURRENCY):
                        tasks.start_soon(worker, first if index % 2 else second)
                    tasks.start_soon(anyio.to_thread.run_sync, usage.sample_for, 5.0)
            took = time.monotonic() - started
            assert flood.process.poll() is None, "the flood stopped on its own"
        finally:
            flood.stop()
    finally:
        assert server.stop() == 0
    print(
        f"{CALLS} calls in {took:.1f} s beside the flood; server at most {usage.fds} fds, {usage.threads} threads"
    )
    assert wrong == []
    assert len(answers) == CALLS
    finished = audit_events(bench, event="call.finished", toolName="echo")
    assert len(finished) == CALLS and all(event["success"] for event in finished)
    # The pool's warm sandboxes went with the server; no call's sandbox is left.
    wait_for(lambda: processes_with_env(f"LOAD_MARK={mark}") == [], 10.0)
    assert usage.fds < 1024
