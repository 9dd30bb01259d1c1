"""The egress proxy of one call: HTTP forwarding and ``CONNECT``, under its allow-lists.

A tool granted ``network: {allow: [...]}`` has loopback only; on it, at
``127.0.0.1:PROXY_PORT``, the backend puts a listener of this proxy (``attach``). The
proxy reads one request head, decides (``egress_rules``), resolves names itself, opens
the connection and relays bytes. Each connection opened or refused is reported once
(``ConnectAttempt``, written as a ``network.connect`` audit event). One proxy serves
all attempts of a call and is closed with the call: every connection ends then.

Bounds per call: ``EgressBounds`` connections and bytes (both directions, all
connections); time is the call's own, since nothing outlives it, plus the timeouts below
on each step a client or a server could stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from runner.call.policy import Policy
from runner.config.egress import EgressRules, IPAddress, NetworkAllow, as_address, canonical_host
from runner.tools.manifest import Tool
from sandboxes import LaunchSpec

# Inside the sandbox's own network namespace, where nothing else listens.
PROXY_PORT = 3128
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")  # curl reads lower case
HEAD_LIMIT = 16 * 1024
# A client that never finishes its request head, a name that never resolves, a server
# that never answers the SYN: none may hold a connection slot for long.
HEAD_TIMEOUT_S = 10.0
RESOLVE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 10.0
COPY_CHUNK = 64 * 1024
_METHOD = re.compile(r"[A-Z]{1,16}")
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate", "te",
     "trailer", "upgrade", "host"}
)  # fmt: skip

Decision = Literal["allow", "deny"]


@dataclass(frozen=True)
class EgressBounds:
    """What one call's tool may use through the proxy, over all its attempts."""

    max_connections: int = 32
    max_bytes: int = 64 * 1024 * 1024
    # Connections from the tool served at once: each is a descriptor of the runner, whose
    # table every call shares. More wait in the listener's backlog, in the kernel.
    max_clients: int = 64
    # Refusals audited per call. Every refusal is an audit event, so a tool that
    # loops on refused requests would write thousands of lines a second: at this many the
    # proxy says so once (reason refusal_limit) and stops listening, and the tool's further
    # connections are refused by its own kernel, with nothing reaching the runner.
    max_refusals: int = 200


@dataclass(frozen=True)
class ConnectAttempt:
    """One connection the proxy opened or refused, for the audit trail."""

    decision: Decision
    # allowed, or why not: not_allowed, private_address, unresolvable, connect_failed,
    # connection_limit, bad_request, refusal_limit (the last event: the proxy stopped)
    reason: str
    method: str
    host: str | None
    port: int | None
    address: str | None = None

    def audit_fields(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "reason": self.reason,
            "method": self.method,
            "host": self.host,
            "port": self.port,
            "address": self.address,
        }


Reporter = Callable[[ConnectAttempt], None]


class EgressRefused(Exception):
    """A request the proxy will not forward: ``reason`` for the audit, ``status`` for the tool."""

    def __init__(self, reason: str, status: int, address: IPAddress | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.address = address


@dataclass(frozen=True)
class ProxyRequest:
    method: str
    host: str
    port: int
    forward: bytes  # what goes upstream first (an HTTP request's rewritten head); empty for CONNECT


class EgressProxy:
    """The proxy of one call; an ``sandboxes.EgressEndpoint``. Use it ``async with``."""

    port = PROXY_PORT

    def __init__(self, rules: EgressRules, report: Reporter, bounds: EgressBounds | None = None) -> None:
        self._rules = rules
        self._report = report
        self._bounds = bounds or EgressBounds()
        self._listeners: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[Any]] = set()
        self._slots = asyncio.Semaphore(self._bounds.max_clients)
        self._opened = 0
        self._bytes = 0
        self._refusals = 0
        self._closed = False

    async def __aenter__(self) -> EgressProxy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def attach(self, listener: socket.socket) -> None:
        if self._closed:
            listener.close()
            raise RuntimeError("the call's egress proxy is closed")
        listener.setblocking(False)
        self._listeners.append(listener)
        self._acceptors.append(asyncio.create_task(self._accept(listener)))

    async def aclose(self) -> None:
        """Stop listening and end every connection. Safe to call twice."""
        self._closed = True
        self._stop_listening()
        await asyncio.gather(*self._acceptors, return_exceptions=True)
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        self._acceptors.clear()
        self._listeners.clear()

    def _stop_listening(self) -> None:
        for acceptor in self._acceptors:
            acceptor.cancel()
        for listener in self._listeners:
            listener.close()

    def _deny(self, attempt: ConnectAttempt) -> None:
        """Audit a refusal; past ``max_refusals`` stop listening, and say so once."""
        if self._refusals >= self._bounds.max_refusals:
            return
        self._refusals += 1
        self._report(attempt)
        if self._refusals == self._bounds.max_refusals:
            self._report(ConnectAttempt("deny", "refusal_limit", "-", None, None))
            self._stop_listening()

    async def _accept(self, listener: socket.socket) -> None:
        """Accept only while fewer than ``max_clients`` connections are served (not
        ``asyncio.start_server``, which accepts whatever comes: a tool could make the
        runner hold a descriptor for each of thousands of idle connections)."""
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                connection, _ = await loop.sock_accept(listener)
            except OSError:
                self._slots.release()
                await asyncio.sleep(0.05)  # out of descriptors, say: try again, never spin
                continue
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._serve_socket(connection))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve_socket(self, connection: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=connection, limit=HEAD_LIMIT)
        except BaseException:
            connection.close()
            self._slots.release()
            raise
        try:
            await self._handle(reader, writer)
        finally:
            self._slots.release()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not self._closed:  # accepted just as the call ended: nothing more is opened
                await self._serve(reader, writer)
        except OSError:
            pass  # either side went away: the connection is over, as the tool will see
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            request = parse_head(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, EgressRefused):
            self._deny(ConnectAttempt("deny", "bad_request", "?", None, None))
            await _refuse(writer, 400, "bad_request")
            return
        try:
            upstream_reader, upstream_writer, address = await self._open(request.host, request.port)
        except EgressRefused as refused:
            refused_at = str(refused.address) if refused.address is not None else None
            self._deny(
                ConnectAttempt("deny", refused.reason, request.method, request.host, request.port, refused_at)
            )
            await _refuse(writer, refused.status, refused.reason)
            return
        opened = ConnectAttempt("allow", "allowed", request.method, request.host, request.port, str(address))
        self._report(opened)
        try:
            if request.method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream_writer.write(request.forward)
            await self._relay(reader, writer, upstream_reader, upstream_writer)
        finally:
            upstream_writer.close()

    async def _open(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, IPAddress]:
        """Decide, resolve and connect.

        Raises:
            EgressRefused: not allowed, over the bounds, unresolvable or unreachable.
        """
        if self._opened >= self._bounds.max_connections:
            raise EgressRefused("connection_limit", 403)
        if not self._rules.allows_name(host, port):
            raise EgressRefused("not_allowed", 403)
        addresses = await _resolve(host, port)
        for address in addresses:
            # One address that may not be reached makes the whole name refused: an answer
            # that points into the host or the internal network is not to be trusted.
            if not self._rules.allows_address(address, port):
                raise EgressRefused("private_address", 403, address)
        self._opened += 1
        for address in addresses:
            with contextlib.suppress(OSError, TimeoutError):
                opening = asyncio.open_connection(str(address), port, limit=COPY_CHUNK)
                reader, writer = await asyncio.wait_for(opening, CONNECT_TIMEOUT_S)
                return reader, writer, address
        raise EgressRefused("connect_failed", 502, addresses[0])

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
    ) -> None:
        try:
            async with asyncio.TaskGroup() as pumps:
                pumps.create_task(self._pump(reader, upstream_writer))
                pumps.create_task(self._pump(upstream_reader, writer))
        except* (OSError, _ByteLimit):
            pass  # one side failed or the call's bytes ran out: both directions end

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while chunk := await source.read(COPY_CHUNK):
            self._bytes += len(chunk)
            if self._bytes > self._bounds.max_bytes:
                raise _ByteLimit
            sink.write(chunk)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()  # half-close: the other direction may still be talking


class _ByteLimit(Exception):
    """The call's tool moved more bytes through the proxy than its bound."""


async def _resolve(host: str, port: int) -> list[IPAddress]:
    address = as_address(host)
    if address is not None:
        return [address]
    loop = asyncio.get_running_loop()
    try:
        lookup = loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        infos = await asyncio.wait_for(lookup, RESOLVE_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        raise EgressRefused("unresolvable", 502) from exc
    addresses: list[IPAddress] = []
    for info in infos:
        found = as_address(str(info[4][0]))
        if found is None:
            raise EgressRefused("unresolvable", 502)
        if found not in addresses:
            addresses.append(found)
    if not addresses:
        raise EgressRefused("unresolvable", 502)
    return addresses


async def _refuse(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    body = f"runner egress proxy: {reason}\n".encode()
    phrase = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
    head = f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
    with contextlib.suppress(OSError):
        writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
        await writer.drain()


def parse_head(head: bytes) -> ProxyRequest:
    """A proxy request: ``CONNECT host:port`` or an absolute ``http://`` URL.

    Raises:
        EgressRefused: anything else (reason ``bad_request``).
    """
    bad = EgressRefused("bad_request", 400)
    lines = head.decode("latin-1").split("\r\n")[:-2]
    parts = lines[0].split(" ") if lines else []
    if len(parts) != 3 or not _METHOD.fullmatch(parts[0]) or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise bad
    if any("\n" in line or "\r" in line for line in lines):
        raise bad
    method, target, version = parts
    try:
        if method == "CONNECT":
            url = urllib.parse.urlsplit(f"//{target}")
            if url.hostname is None or url.port is None or url.netloc != target:
                raise bad
            return ProxyRequest(method, canonical_host(url.hostname), url.port, b"")
        url = urllib.parse.urlsplit(target)
        if url.scheme != "http" or url.hostname is None or url.username is not None:
            raise bad  # https:// goes through CONNECT; credentials in a URL are not forwarded
        host, port = canonical_host(url.hostname), url.port or 80
    except ValueError as exc:  # a bad port or host name
        raise bad from exc
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    headers = [line for line in lines[1:] if line.split(":", 1)[0].strip().lower() not in _HOP_BY_HOP]
    # The Host header is the URL's: the tool cannot name one server and ask another.
    authority = f"[{host}]" if ":" in host else host
    headers += [f"Host: {authority}" if port == 80 else f"Host: {authority}:{port}", "Connection: close"]
    forward = f"{method} {path} {version}\r\n" + "".join(f"{line}\r\n" for line in headers) + "\r\n"
    return ProxyRequest(method, host, port, forward.encode("latin-1"))


def egress_rules(tool: Tool, policy: Policy) -> EgressRules | None:
    """The rules of a tool with an allow-list; None for a tool without one."""
    wanted = tool.manifest.network
    if not isinstance(wanted, NetworkAllow):
        return None
    override = policy.model.tools.get(tool.name)
    granted = override.network if override is not None else None
    return EgressRules(wanted.destinations(), granted.destinations() if granted is not None else ())


@contextlib.asynccontextmanager
async def call_egress(
    tool: Tool, policy: Policy, spec: LaunchSpec, report: Reporter
) -> AsyncIterator[LaunchSpec]:
    """The call's launch spec, with the egress proxy and its variables when the tool has an
    allow-list; the proxy is closed, its connections ended, when the block is left."""
    rules = egress_rules(tool, policy)
    if rules is None:
        yield spec
        return
    async with EgressProxy(rules, report) as proxy:
        url = f"http://127.0.0.1:{proxy.port}"
        yield replace(spec, egress=proxy, env={**spec.env, **dict.fromkeys(PROXY_VARIABLES, url)})
