"""``runner serve --http ... --metrics ...`` against local users without a token: idle
connections held by ``nobody`` against both listeners starve neither of descriptors or
threads; a request head that never ends is cut off; ``/metrics`` behind a scrape token.
The server is the real process, started with systemd's default soft RLIMIT_NOFILE (1024);
the client with a token is the MCP SDK's."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import h11
import httpx2
import mcp_types as types
import pytest
from conftest import ToolBench, wait_for
from support.flood_harness import Flood, Usage, port_of, soft_nofile
from support.mcp_harness import ECHO, HttpServer, add_token, server_argv
from support.mcp_raw import ACCEPT, INITIALIZE

pytestmark = pytest.mark.anyio

# systemd's default soft limit, which the runner used to keep.
SOFT_NOFILE = 1024
# A generous bound for a client with a token to initialize and call while the flood runs.
THROUGH_S = 60.0
ADMIN_TOOL = "rotate_keys"
# The default head timeout is 10 s: a connection must be gone well before this.
HEAD_BOUND_S = 25.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def tools(bench: ToolBench) -> Iterator[str]:
    """An echo tool for a user, an admin-only tool, and the user's token."""
    bench.tool("echo", ECHO)
    bench.tool(ADMIN_TOOL, ECHO)
    bench.policy["roles"] = {"user": {"allow": ["echo"]}, "admin": {"inherits": ["user"], "allow": ["*"]}}
    yield add_token(bench, "agent", "user")


def _read_all(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """What the server sent until it closed ``sock``; fails if it is still open after ``timeout_s``."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection is still open after {timeout_s} s (received {received[:80]!r})")
    return received


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_idle_connections_of_a_local_user_on_both_ports_leave_a_client_with_a_token_its_calls(
    bench: ToolBench, tools: str
) -> None:
    server = HttpServer(bench, "--metrics", "127.0.0.1:0", soft_nofile=SOFT_NOFILE)
    pid = server.process.pid
    usage = Usage(pid)
    try:
        baseline = _fds(pid)
        limit = soft_nofile(pid)  # raised to the hard limit at start
        flood = Flood([port_of(server.url), port_of(server.metrics_url)])
        try:
            report = flood.wait_holding(ticks=3)
            await anyio.to_thread.run_sync(usage.sample_for, 2.0)
            started = time.monotonic()
            with anyio.fail_after(THROUGH_S):
                async with server.client(tools) as client:
                    result = await client.call_tool("echo", {"word": "through"})
                async with httpx2.AsyncClient(timeout=THROUGH_S) as http:
                    scrape = await http.get(server.metrics_url)
            took = time.monotonic() - started
            usage.sample()
            assert flood.process.poll() is None
        finally:
            flood.stop()
        # Nothing lasting: once the flood is gone, so are its descriptors.
        wait_for(lambda: _fds(pid) <= baseline + 8, 30.0)
    finally:
        assert server.stop() == 0
    assert not result.is_error and isinstance(result.content[0], types.TextContent)
    assert json.loads(result.content[0].text) == {"word": "through"}
    assert scrape.status_code == 200 and "runner_calls_total" in scrape.text
    print(f"through in {took:.2f} s; server at most {usage.fds} fds (soft limit now {limit}),")
    print(f"{usage.threads} threads; flood {report}")
    assert usage.fds < SOFT_NOFILE, f"{usage.fds} descriptors open"
    assert usage.threads < 64, f"{usage.threads} threads"


async def test_a_request_head_that_never_ends_is_cut_off_on_both_ports_and_a_401_closes_its_connection(
    bench: ToolBench, tools: str
) -> None:
    server = HttpServer(bench, "--metrics", "127.0.0.1:0")
    try:
        slow = [
            socket.create_connection(("127.0.0.1", port_of(url)), timeout=10)
            for url in (server.url, server.metrics_url)
        ]
        for sock in slow:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        for sock in slow:
            with sock:
                # Closed unanswered by the head timeout (10 s by default).
                assert _read_all(sock, timeout_s=HEAD_BOUND_S) == b""
        # A request without a token is answered 401, and its connection is closed with it.
        with socket.create_connection(("127.0.0.1", port_of(server.url)), timeout=10) as refused:
            refused.sendall(b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            answer = _read_all(refused)
        assert answer.startswith(b"HTTP/1.1 401")
    finally:
        assert server.stop() == 0


async def test_the_policy_caps_connections_per_peer_evicting_the_oldest_idle_one_first(
    bench: ToolBench, tools: str
) -> None:
    bench.policy["serve"]["connections"] = {"max_per_peer": 8, "header_timeout_ms": 20000}
    server = HttpServer(bench)
    idle = [socket.create_connection(("127.0.0.1", port_of(server.url)), timeout=10) for _ in range(20)]
    try:
        # The twelve oldest made room for the eight newest, at once (no head timeout yet).
        assert [_read_all(sock, timeout_s=5.0) for sock in idle[:12]] == [b""] * 12
        async with server.client(tools) as client:  # and those, in turn, for a client with a token
            result = await client.call_tool("echo", {"n": 1})
        assert not result.is_error
    finally:
        for sock in idle:
            sock.close()
        assert server.stop() == 0


async def test_a_scrape_token_guards_metrics_that_name_every_tool_admin_ones_included(
    bench: ToolBench, tools: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCRAPE_TOKEN", "scrape-secret-7f3a")
    server = HttpServer(bench, "--metrics", "127.0.0.1:0", "--metrics-token-env", "SCRAPE_TOKEN")
    try:
        async with server.client(tools) as client:
            await client.call_tool("echo", {})
        async with httpx2.AsyncClient(timeout=10) as http:
            missing = await http.get(server.metrics_url)
            wrong = await http.get(server.metrics_url, headers={"Authorization": "Bearer scrape-secret-7f3b"})
            longer = await http.get(
                server.metrics_url, headers={"Authorization": "Bearer scrape-secret-7f3a0"}
            )
            right = await http.get(server.metrics_url, headers={"Authorization": "Bearer scrape-secret-7f3a"})
    finally:
        assert server.stop() == 0
    for refused in (missing, wrong, longer):
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert ADMIN_TOOL not in refused.text and "echo" not in refused.text
    assert right.status_code == 200
    # What the page reveals to whoever may scrape it: every tool's name, the admin's too.
    assert f'tool="{ADMIN_TOOL}"' in right.text or ADMIN_TOOL in right.text


def _one_answer(sock: socket.socket) -> bytes:
    """One whole answer (its head and its content-length's body), the connection left open."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(row.split(b":")[1]) for row in head.lower().split(b"\r\n") if row.startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


async def test_a_metrics_request_is_answered_at_its_head_and_only_a_scrape_with_the_token_keeps_its_connection(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 401 waited for the request's whole body, read until the head timeout (a core kept
    # busy by a peer sending forever); without a token every scrape was trusted, so a
    # local user could hold every slot with scrapes of its own.
    monkeypatch.setenv("SCRAPE_TOKEN", "scrape-secret-7f3a")
    server = HttpServer(bench, "--metrics", "127.0.0.1:0", "--metrics-token-env", "SCRAPE_TOKEN")
    open_server = HttpServer(bench, "--metrics", "127.0.0.1:0")
    try:
        port = port_of(server.metrics_url)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n")
            sock.sendall(b"x" * 65536)
            started = time.monotonic()
            answer = _read_all(sock, timeout_s=HEAD_BOUND_S)
            took = time.monotonic() - started
        scrape = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port_of(open_server.metrics_url)), timeout=10) as sock:
            sock.sendall(scrape)
            unkept = _read_all(sock, timeout_s=HEAD_BOUND_S)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(scrape.replace(b"\r\n\r\n", b"\r\nAuthorization: Bearer scrape-secret-7f3a\r\n\r\n"))
            sock.settimeout(5)
            kept = _one_answer(sock)
            sock.sendall(scrape)  # the connection still serves: a 401 on it, then the close
            after = _read_all(sock, timeout_s=HEAD_BOUND_S)
    finally:
        assert server.stop() == 0
        assert open_server.stop() == 0
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]
    assert took < 5.0, f"the 401 came {took:.1f} s after the head (the head timeout is 10 s)"
    assert unkept.startswith(b"HTTP/1.1 200") and b"connection: close" in unkept.lower()
    assert kept.startswith(b"HTTP/1.1 200") and b"connection: close" not in kept.lower()
    assert after.startswith(b"HTTP/1.1 401"), after[:80]


def test_a_metrics_token_variable_that_is_unset_is_a_usage_error(bench: ToolBench) -> None:
    metrics = ("--metrics", "127.0.0.1:0", "--metrics-token-env", "NO_SUCH")
    argv = server_argv(bench, "--http", "127.0.0.1:0", *metrics)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, "NO_SUCH": ""})
    assert done.returncode == 2
    assert "--metrics-token-env NO_SUCH" in done.stderr and "Traceback" not in done.stderr


async def test_malformed_bodies_without_a_token_leave_no_traceback_and_a_bounded_log(
    bench: ToolBench, tools: str
) -> None:
    # uvicorn answered the malformed chunk with a 400 itself and the 401 that followed met
    # an ended response: a traceback of thirty lines in the operator's log per request.
    server = HttpServer(bench)
    port = port_of(server.url)
    requests = 40  # uvicorn's own line for each would be 40 alone

    def malformed() -> None:
        for _ in range(requests):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(b"POST /mcp HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
                with contextlib.suppress(OSError):
                    sock.recv(4096)

    try:
        await anyio.to_thread.run_sync(malformed)
        with anyio.fail_after(THROUGH_S):
            async with server.client(tools) as client:
                result = await client.call_tool("echo", {"word": "through"})
    finally:
        assert server.stop() == 0
    log = "".join(server.stderr)
    assert "Traceback" not in log, log[-2000:]
    assert log.count("Invalid HTTP request received") <= 20, log[-2000:]
    assert not result.is_error


async def test_a_websocket_upgrade_without_a_token_is_answered_as_plain_http_and_closed(
    bench: ToolBench, tools: str
) -> None:
    server = HttpServer(bench)
    port = port_of(server.url)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"GET /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            answer = _read_all(sock, 10.0)
    finally:
        assert server.stop() == 0
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]  # the bearer check saw it
    assert b"101 Switching" not in answer


def test_a_kept_alive_connection_waits_its_idle_timeout_before_its_next_head_is_timed(
    bench: ToolBench, tools: str
) -> None:
    # The head timer of a kept-alive connection's next request started with the last
    # answer: idle longer than the head timeout, it was reset, even within the idle one.
    bench.policy["serve"]["connections"] = {"header_timeout_ms": 1000, "idle_timeout_ms": 4000}
    server = HttpServer(bench)
    try:
        host, port = "127.0.0.1", port_of(server.url)
        request = json.dumps(INITIALIZE).encode()
        head = [
            ("Host", f"{host}:{port}"),
            ("Authorization", f"Bearer {tools}"),
            ("Accept", ACCEPT),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(request))),
        ]
        with socket.create_connection((host, port), timeout=10) as sock:
            statuses = []
            client = h11.Connection(h11.CLIENT)
            for pause in (0.0, 2.5):  # past the head timeout, within the idle one
                time.sleep(pause)
                sock.sendall(client.send(h11.Request(method="POST", target="/mcp", headers=head)))
                sock.sendall(client.send(h11.Data(data=request)) + client.send(h11.EndOfMessage()))
                while (event := client.next_event()) is not h11.PAUSED and not isinstance(
                    event, h11.EndOfMessage
                ):
                    if event is h11.NEED_DATA:
                        client.receive_data(sock.recv(65536))
                    elif isinstance(event, h11.Response):
                        statuses.append(event.status_code)
                client.start_next_cycle()
        assert statuses == [200, 200]
    finally:
        assert server.stop() == 0


# Connections held by the flood while the server is stopped: far more than asyncio's
# accept batch (64), which used to be the kernel's queue too.
QUEUED = 400


def _answer_head(port: int) -> bytes:
    """The head of the answer to a request without a token, on a connection of its own."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        return sock.recv(64)


def _queued(port: int) -> int:
    """Connections waiting in the queue of the listener on ``port`` (for a listening
    socket, ``/proc/net/tcp``'s ``rx_queue`` is its queue's length)."""
    queued = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            queued += int(fields[4].split(":")[1], 16)
    return queued


async def test_a_flood_that_outruns_the_server_leaves_a_clients_new_connection_its_turn(
    bench: ToolBench, tools: str
) -> None:
    """While the server is stopped (a busy event loop, in the extreme), a flood from
    another address opens hundreds of connections to each listener. They wait in its queue,
    and so does a client's, behind them: none is dropped by the kernel (whose handshake,
    sent again a second later and more, could lose to the flood's each time), and the
    client is answered once the server runs again."""
    server = HttpServer(bench, "--metrics", "127.0.0.1:0", soft_nofile=SOFT_NOFILE)
    port, metrics = port_of(server.url), port_of(server.metrics_url)
    try:
        assert _answer_head(port).startswith(b"HTTP/1.1 401")  # serving
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            flood = Flood([port, metrics], count=QUEUED, source="127.0.0.2")
            try:
                wait_for(lambda: _queued(port) >= QUEUED and _queued(metrics) >= QUEUED, 30.0)
                with concurrent.futures.ThreadPoolExecutor(1) as client:
                    answer = client.submit(_answer_head, port)
                    wait_for(lambda: _queued(port) >= QUEUED + 1, 30.0)
                    os.kill(server.process.pid, signal.SIGCONT)
                    head = answer.result(timeout=60)
                assert flood.process.poll() is None
            finally:
                flood.stop()
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    finally:
        assert server.stop() == 0
    assert head.startswith(b"HTTP/1.1 401"), head
