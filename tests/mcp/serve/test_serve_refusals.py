"""Requests without a token cannot grow the audit log without bound: each peer's refusals
are audited up to a budget, then counted into one summary event; the peers tracked are
bounded too. The 401 is a JSON-RPC error that MCP clients show. Real server process,
httpx and the SDK's client; the budget's own rules on a fake clock."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx2
import pytest
from conftest import ToolBench
from support.mcp_harness import ECHO, HttpServer, add_token, audit_events
from support.mcp_raw import jsonrpc_error

from runner.mcp.serve.refusals import MAX_PEERS, PER_PEER, WINDOW_S, RefusalBudget, peer_key

pytestmark = pytest.mark.anyio
PING = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
# One TLS context for the many clients (plain HTTP here; building one per client is slow).
_TLS = ssl.create_default_context()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def served(bench: ToolBench) -> Iterator[tuple[HttpServer, str]]:
    bench.tool("echo", ECHO)
    bench.policy["roles"] = {"user": {"allow": ["echo"]}}
    token = add_token(bench, "ci-agent", "user")
    server = HttpServer(bench)
    yield server, token
    server.stop()


async def refuse_many(
    url: str, count: int, *, local_address: str | None = None, workers: int = 8
) -> list[int]:
    """``count`` requests without a token (every other one with a made-up token); the statuses."""
    statuses: list[int] = []
    transport = httpx2.AsyncHTTPTransport(local_address=local_address, verify=_TLS)
    async with httpx2.AsyncClient(transport=transport, timeout=30) as http:

        async def worker(share: int) -> None:
            for n in range(share):
                guessed = {"Authorization": f"Bearer rnr_guess{n}"} if n % 2 else {}
                statuses.append((await http.post(url, json=PING, headers=guessed)).status_code)

        async with anyio.create_task_group() as tasks:
            for w in range(workers):
                tasks.start_soon(worker, count // workers + (w < count % workers))
    return statuses


def serve_auth_events(bench: ToolBench) -> list[dict[str, Any]]:
    return audit_events(bench, event="serve.auth")


async def test_thousands_of_refused_requests_write_a_budget_of_events_then_one_summary_with_their_count(
    bench: ToolBench, served: tuple[HttpServer, str]
) -> None:
    server, token = served
    before = bench.audit_log.stat().st_size
    statuses = await refuse_many(server.url, 2000)
    assert statuses == [401] * 2000
    one_by_one = serve_auth_events(bench)
    assert len(one_by_one) == PER_PEER
    assert bench.audit_log.stat().st_size - before < PER_PEER * 1000
    async with httpx2.AsyncClient() as http:
        answer = await http.post(server.url, json=PING)
    error = jsonrpc_error(answer)
    assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")
    assert "unauthorized" in error["message"] and "Bearer" in error["message"]
    async with server.client(token) as client:  # a client with a token is not held back
        assert [tool.name for tool in (await client.list_tools()).tools] == ["echo"]
    assert server.stop() == 0
    [summary] = audit_events(bench, event="serve.auth", reason="summary")
    assert summary["peer"] == "127.0.0.1" and summary["decision"] == "deny"
    assert summary["refused"] == 2001 and summary["count"] == 2001 - PER_PEER
    assert len(serve_auth_events(bench)) == PER_PEER + 1


async def test_the_sdk_client_with_a_wrong_token_shows_why_it_was_refused(
    served: tuple[HttpServer, str],
) -> None:
    server, _ = served
    with pytest.raises(Exception) as refused:  # the SDK wraps it in a group; its leaves are checked
        async with server.client("rnr_guessed"):
            pass
    texts: list[str] = []
    pending: list[BaseException | None] = [refused.value]
    while pending:
        error = pending.pop()
        if error is not None:
            texts.append(str(error))
            pending += [*getattr(error, "exceptions", ()), error.__cause__]
    assert any("unauthorized" in text and "Bearer" in text for text in texts), texts


async def test_past_max_peers_addresses_share_one_budget_and_no_refusal_goes_uncounted(
    bench: ToolBench, served: tuple[HttpServer, str]
) -> None:
    server, _ = served
    addresses = [f"127.0.{1 + n // 200}.{1 + n % 200}" for n in range(MAX_PEERS + 50)]
    tracked, newcomers = addresses[:MAX_PEERS], addresses[MAX_PEERS:]
    started = time.monotonic()

    async def spray(peers: list[str], each: int) -> None:
        for address in peers:
            assert await refuse_many(server.url, each, local_address=address, workers=1) == [401] * each

    async with anyio.create_task_group() as tasks:  # one refusal from each: the table is full
        for start in range(0, len(tracked), 32):
            tasks.start_soon(spray, tracked[start : start + 32], 1)
    await spray(newcomers, 3)  # 150 refusals from 50 peers the table has no room for
    elapsed = time.monotonic() - started
    assert server.stop() == 0
    assert elapsed < WINDOW_S, "too slow for one window: the counts below assume one"
    events = serve_auth_events(bench)
    from_newcomers = [e for e in events if e.get("peer", "").rsplit(":", 1)[0] in newcomers]
    assert len(from_newcomers) == PER_PEER  # not 150: they share one budget
    [other] = [e for e in events if e["reason"] == "summary"]
    assert other["peer"] == "other" and other["count"] == 150 - PER_PEER
    assert len(events) == MAX_PEERS + PER_PEER + 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_window_that_ends_is_summarised_once_and_the_next_starts_afresh() -> None:
    events: list[dict[str, Any]] = []
    clock = Clock()
    budget = RefusalBudget(lambda **fields: events.append(fields), per_peer=2, window_s=10, clock=clock)
    for _ in range(5):
        budget.refused("10.0.0.1", reason="missing_token")
    assert [e["reason"] for e in events] == ["missing_token"] * 2
    clock.now = 9.9
    budget.sweep()
    assert len(events) == 2  # the window has not ended
    clock.now = 10.0
    budget.refused("10.0.0.1", reason="missing_token")  # ends the old window, opens a new one
    assert events[2] == {"reason": "summary", "peer": "10.0.0.1", "count": 3, "refused": 5, "seconds": 10.0}
    assert events[3] == {"reason": "missing_token"}
    budget.flush()
    assert len(events) == 4  # within budget: nothing to summarise


def test_past_max_peers_new_peers_share_one_budget_and_ipv6_counts_by_its_64() -> None:
    events: list[dict[str, Any]] = []
    budget = RefusalBudget(lambda **fields: events.append(fields), per_peer=1, max_peers=2, clock=Clock())
    for host in ("2001:db8::1", "2001:db8::2:1", "10.0.0.1", "10.0.0.2", "10.0.0.3", "::ffff:10.0.0.9"):
        budget.refused(host, reason="unknown_token")
    assert len(events) == 3  # the /64, 10.0.0.1, and the first peer beyond the table
    budget.flush()
    summaries = {e["peer"]: e["count"] for e in events if e["reason"] == "summary"}
    assert summaries == {"2001:db8::/64": 1, "other": 2}
    assert peer_key("::ffff:10.0.0.9") == "10.0.0.9" and peer_key(None) == "unknown"
