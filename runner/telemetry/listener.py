"""``/metrics`` on an asyncio listener of its own (``runner serve --metrics HOST:PORT``).

prometheus_client's own server starts a thread per connection, with no bound and no
timeout: idle connections from any local user use up the runner's descriptors and
threads. This listener runs one event loop in one thread, parses HTTP with h11 and holds
its connections through a ``ConnectionGate`` (caps, head and idle timeouts). The page is
``generate_latest`` of the runner's registry.

With a scrape token (``--metrics-token-env VAR``), a request must carry ``Authorization:
Bearer TOKEN`` (compared in constant time); anything else is answered 401 and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import socket
import threading

import h11
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from runner.telemetry.connections import (
    ACCEPT_BACKLOG,
    ConnectionGate,
    ConnectionLimits,
    Peer,
    listen_long,
    reset,
    unread,
)
from runner.telemetry.metrics import RunnerMetrics

METRICS_PATH = b"/metrics"
# A request head larger than this is refused (a scraper's is a few hundred bytes).
MAX_HEAD = 16 * 1024
READ_SIZE = 4096
# How long ``close`` waits for the listener's thread.
STOP_WAIT_S = 5.0


class MetricsServer:
    """``/metrics`` of one ``RunnerMetrics``, served from one thread with its own event loop."""

    def __init__(
        self,
        metrics: RunnerMetrics,
        host: str,
        port: int,
        limits: ConnectionLimits | None = None,
        token: str | None = None,
    ) -> None:
        """``token``: the scrape token requests must carry (None: none needed).

        Raises:
            OSError: the address cannot be bound.
        """
        self._metrics = metrics
        self._digest = _digest(token) if token else None
        self.gate = ConnectionGate(limits if limits is not None else ConnectionLimits())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        bound_host, bound_port = self._socket.getsockname()[:2]
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        self.url = f"http://{shown}:{bound_port}/metrics"
        self._loop = asyncio.new_event_loop()
        self._stopping: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-metrics", daemon=True)
        self._thread.start()
        self._started.wait(STOP_WAIT_S)

    def close(self) -> None:
        """Stop listening and close every connection."""
        if self._stopping is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended on its own
                self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=STOP_WAIT_S)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self._socket, backlog=ACCEPT_BACKLOG)
        listen_long(self._socket)
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        peername = writer.get_extra_info("peername")
        peer: Peer = (str(peername[0]), int(peername[1])) if peername else ("", id(writer))
        me = asyncio.current_task()
        if not self.gate.admit(peer, me, reset(transport), unread(transport)):
            reset(transport)()
            return
        if me is not None:
            self._tasks.add(me)
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        try:
            await self._serve_requests(connection, peer, reader, writer)
        except h11.RemoteProtocolError as exc:  # not HTTP, or a head over MAX_HEAD: 400 or 431
            with contextlib.suppress(h11.LocalProtocolError):
                head = [("content-length", "0"), ("connection", "close")]
                writer.write(connection.send(h11.Response(status_code=exc.error_status_hint, headers=head)))
            transport.close()
        except (TimeoutError, ConnectionError, h11.LocalProtocolError):
            reset(transport)()
        finally:
            self.gate.release(peer, me)
            if me is not None:
                self._tasks.discard(me)
            transport.close()

    async def _serve_requests(
        self,
        connection: h11.Connection,
        peer: Peer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        wait = self.gate.limits.header_timeout_s
        while True:
            head = await asyncio.wait_for(_next_request(connection, reader), wait)
            if head is None:
                return
            request, body_follows = head
            trusted, status, headers, body = self._answer(request)
            if trusted and not body_follows:
                self.gate.trust(peer)
            else:
                headers.append(("connection", "close"))
            writer.write(connection.send(h11.Response(status_code=status, headers=headers)))
            if request.method != b"HEAD":
                writer.write(connection.send(h11.Data(data=body)))
            writer.write(connection.send(h11.EndOfMessage()))
            # A client that never reads its answer does not hold the connection either.
            await asyncio.wait_for(writer.drain(), self.gate.limits.idle_timeout_s)
            if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                return  # a body never read, or the connection is to close
            connection.start_next_cycle()
            wait = self.gate.limits.idle_timeout_s

    def _answer(self, request: h11.Request) -> tuple[bool, int, list[tuple[str, str]], bytes]:
        """(trusted, status, headers, body) of ``request``'s answer."""
        plain = [("content-type", "text/plain; charset=utf-8")]
        if self._digest is not None and not self._authorized(request):
            body = b"unauthorized: send Authorization: Bearer TOKEN\n"
            challenge = ("www-authenticate", 'Bearer realm="runner-metrics"')
            return False, 401, [*plain, challenge, ("content-length", str(len(body)))], body
        path = request.target.partition(b"?")[0]
        if request.method not in (b"GET", b"HEAD"):
            body = b"method not allowed\n"
            return False, 405, [*plain, ("allow", "GET, HEAD"), ("content-length", str(len(body)))], body
        if path != METRICS_PATH:
            body = b"not found: the metrics are at /metrics\n"
            return False, 404, [*plain, ("content-length", str(len(body)))], body
        page = generate_latest(self._metrics.registry)
        # Without a token anyone may scrape: such a connection is never kept over another's.
        return (
            self._digest is not None,
            200,
            [("content-type", CONTENT_TYPE_LATEST), ("content-length", str(len(page)))],
            page,
        )

    def _authorized(self, request: h11.Request) -> bool:
        if self._digest is None:
            return True
        for name, value in request.headers:
            if name == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                # Digests of equal length, compared in constant time: neither the token
                # nor its length leaks through the time of an answer.
                matches = hmac.compare_digest(_digest(given.strip()), self._digest)
                return scheme.lower() == "bearer" and matches
        return False


async def _next_request(
    connection: h11.Connection, reader: asyncio.StreamReader
) -> tuple[h11.Request, bool] | None:
    """The next request's head, and whether a body follows it: a body is never read (the
    answer closes the connection), so a refused peer costs no reading of what it sends.
    None once the client closed the connection."""
    request: h11.Request | None = None
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            if request is not None:
                return request, True
            connection.receive_data(await reader.read(READ_SIZE))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.EndOfMessage | h11.Data) and request is not None:
            return request, isinstance(event, h11.Data)
        else:  # the connection closed, or paused
            return None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
