"""``runner serve --socket [PATH]``: calls from ``runner exec`` on a Unix socket.

Not MCP: one JSON line in, one JSON line out, then the connection closes. The request line
is ``{"request": <wire request>, "where": {"policies", "tools", "auditLog"}}``, where
``where`` is what the caller's own ``runner exec`` would load; the answer line is
``{"answer": <answer shell>}``, or ``{"refused": {"reason", "message"}}`` when the call was
not run (the caller then calls directly). Strict JSON: NaN and Infinity are refused.

Who may call is decided by the peer's credentials (``SO_PEERCRED``), before a byte is read:
the server's own user calls with the role it asks for (the policy's ``default_role`` when it
asks for none, as ``runner exec`` would), a uid in ``serve.socket.uids`` with its role
there, anyone else is refused (audited within a budget, like HTTP's refusals). What a peer
can cost is bounded: ``serve.socket.max_open`` connections at once, lowered to the
listener's share of the descriptor limit (more are closed unread), half of them per
uid other than the server's own and three quarters for all of those, ``read_timeout_ms``
for the request line, ``MAX_REQUEST_BYTES`` for its size and ``MAX_CONTAINERS`` for the
objects and arrays in it (what parsing it costs); a long line is parsed and checked
(``LARGE_LINE``) one at a time, in a thread. A call whose client goes away
(its connection closed whole, e.g. Ctrl-C) is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import select
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic.alias_generators import to_camel

from runner.call.requests import check_json
from runner.config.sockets import MAX_REQUEST_BYTES, SocketPlaceError, prepare_folder
from runner.errors import CallError
from runner.mcp.serve.app import ToolService
from runner.mcp.serve.lifecycle import Transport
from runner.mcp.serve.refusals import RefusalBudget
from runner.telemetry.connections import ACCEPT_BACKLOG, listen_long

# Objects and arrays in a request line, counted (as opening brackets, those in strings
# too) before it is parsed: parsing holds the interpreter's lock whatever thread it runs
# in, and what it costs grows with them (docs/performance.md). A tool call carries far
# fewer.
MAX_CONTAINERS = 1_000_000
# A line longer than this is served one at a time (others are refused busy), parsed in a
# thread where the walk that checks its size and depth lets the loop run: what many large
# lines at once would cost the server in memory and in stalls of every client's loop is
# that of one.
LARGE_LINE = 64 * 1024

HANG_UP_POLL_S = 0.1  # how often a client that shut its writing side is looked at
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_PROBE_S = 1.0  # how long the check for a live server at the socket's path may wait
_REQUEST_KEYS = frozenset({"request", "where"})


@dataclass(frozen=True)
class Where:
    """What a call loads: the policy file, the tool folders, the audit log (resolved paths)."""

    policies: str
    tools: tuple[str, ...]
    audit_log: str | None

    @classmethod
    def of(cls, policies: str | Path, tools: list[Path] | list[str], audit_log: str | Path | None) -> Where:
        return cls(
            os.path.realpath(policies),
            tuple(os.path.realpath(folder) for folder in tools),
            None if audit_log is None else os.path.realpath(audit_log),
        )

    @classmethod
    def parse(cls, document: object) -> Where | None:
        """The ``where`` of a request line, its paths as sent (the client resolves them:
        resolving a peer's path here could block the event loop on a mount it controls);
        None when it is not well-formed."""
        if not isinstance(document, dict) or set(document) != {"policies", "tools", "auditLog"}:
            return None
        policies, tools, audit_log = document["policies"], document["tools"], document["auditLog"]
        if not isinstance(policies, str) or not isinstance(tools, list):
            return None
        if not all(isinstance(folder, str) for folder in tools):
            return None
        if audit_log is not None and not isinstance(audit_log, str):
            return None
        return cls(policies, tuple(tools), audit_log)


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Listener:
    """A bound, listening socket, and which file at ``path`` is its own."""

    sock: socket.socket
    path: Path
    inode: int


def bind(path: Path, *, shared: bool) -> Listener:
    """A listening socket at ``path``: 0600 (``shared``, when other uids are admitted: 0666,
    the peer's credentials then decide), in a folder of this user's (0700 unless ``shared``).
    A socket left behind by a server that is gone is replaced; anything else is not.

    Raises:
        SocketPlaceError: the place is not safe, or another server listens there.
    """
    prepare_folder(path, private=not shared)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None:
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
            raise SocketPlaceError(f"{path} exists and is not a socket of this user; it is left alone")
        if _live(path):
            raise SocketPlaceError(f"another server already listens on {path}")
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # never open to others, not even between bind and chmod
    try:
        listener.bind(str(path))
        path.chmod(0o666 if shared else 0o600)
        inode = path.lstat().st_ino
    except OSError as exc:
        listener.close()
        raise SocketPlaceError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(umask)
    listener.listen(ACCEPT_BACKLOG)
    listener.setblocking(False)
    return Listener(listener, path, inode)


def _live(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_S)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # a full backlog: someone is there
    finally:
        probe.close()
    return True


class SocketTransport:
    """Serves ``runner exec`` calls on ``listener`` (see the module's docstring)."""

    def __init__(self, service: ToolService, listener: Listener, where: Where, most: int) -> None:
        self._service = service
        self._most = most  # the descriptors' share: caps serve.socket.max_open, reloads included
        self._listener = listener
        self._where = where
        self._stopped = asyncio.Event()
        self._connections: set[asyncio.Task[Any]] = set()
        self._serving_large = False  # a large line, from its parsing to its answer
        self._held: collections.Counter[int] = collections.Counter()  # by uid, the server's own not
        audit = service.runner.audit
        self._refusals = RefusalBudget(lambda **fields: audit.emit("serve.socket", decision="deny", **fields))

    @property
    def path(self) -> Path:
        return self._listener.path

    async def serve(self) -> None:
        server = await asyncio.start_unix_server(
            self._connection, sock=self._listener.sock, limit=MAX_REQUEST_BYTES + 1, backlog=ACCEPT_BACKLOG
        )
        listen_long(self._listener.sock)
        try:
            async with server:
                await self._stopped.wait()
        finally:
            self._remove()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            self._refusals.flush()

    def stop(self) -> None:
        self._stopped.set()

    def _remove(self) -> None:
        """Unlink the socket, if what is at its path is still ours."""
        try:
            path = self._listener.path
            if path.lstat().st_ino == self._listener.inode:
                path.unlink()
        except OSError:
            pass

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        settings = self._service.runner.policy.model.serve.socket  # read at each call: SIGHUP reloads it
        counted: int | None = None
        large = False
        try:
            uid = _peer_uid(writer)
            client = f"uid:{uid}"
            try:
                most = min(settings.max_open, self._most)
                if len(self._connections) > most:
                    self._refuse(client, "busy", f"serve.socket.max_open ({most}) reached")
                role = self._role_of(uid, client)
                if uid != os.getuid():
                    self._share(uid, most, client)
                    self._held[counted := uid] += 1
                if self._service.draining:
                    raise _Refused("draining", "the server is shutting down")
                request, large = await self._read(reader, settings.read_timeout_ms / 1000, role)
            except _Refused as refused:
                # Written without waiting: a refused peer holds nothing once it is closed.
                writer.write(_line({"refused": {"reason": refused.reason, "message": refused.message}}))
                return
            except TimeoutError:
                return
            answer = await self._call_watching(reader, writer.get_extra_info("socket"), request, client)
            if answer is not None:
                writer.write(_line({"answer": answer}))
                async with asyncio.timeout(settings.read_timeout_ms / 1000):
                    await writer.drain()
        except (OSError, TimeoutError):
            pass  # the client went away, or does not read its answer
        finally:
            writer.close()
            if task is not None:
                self._connections.discard(task)
            if counted is not None:
                self._held[counted] -= 1
            if large:
                self._serving_large = False

    def _share(self, uid: int, most: int, client: str) -> None:
        """Another uid may hold half of the connections, and all of them together three
        quarters: none can lock out another, nor all of them the server's own user."""
        if self._held[uid] >= max(1, most // 2):
            self._refuse(client, "busy", f"this uid holds its share of serve.socket.max_open ({most})")
        if self._held.total() >= most - min(max(1, most // 4), most - 1):
            self._refuse(client, "busy", f"other uids hold their share of serve.socket.max_open ({most})")

    def _refuse(self, client: str, reason: str, message: str) -> None:
        self._refusals.refused(client, reason=reason, peer=client)
        raise _Refused(reason, message)

    def _role_of(self, uid: int, client: str) -> str | None:
        """The role the peer's calls get; None: the role its request asks for."""
        if uid == os.getuid():
            return None
        role = self._service.runner.policy.model.serve.socket.uids.get(uid)
        if role is None:
            self._refuse(client, "uid", f"uid {uid} is not admitted (serve.socket.uids)")
        return role

    async def _read(
        self, reader: asyncio.StreamReader, timeout_s: float, role: str | None
    ) -> tuple[dict[str, Any], bool]:
        """The request, and whether it came on a large line (served alone until answered)."""
        try:
            async with asyncio.timeout(timeout_s):
                line = await reader.readline()
        except (ValueError, asyncio.LimitOverrunError):
            raise _Refused("too_large", f"a request line is at most {MAX_REQUEST_BYTES} bytes") from None
        if not line.endswith(b"\n"):
            raise _Refused("bad_request", "the request line ended early")
        if line.count(b"{") + line.count(b"[") > MAX_CONTAINERS:
            raise _Refused("too_large", f"a request line holds at most {MAX_CONTAINERS} objects and arrays")
        if len(line) <= LARGE_LINE:
            return self._request(_parsed(line), role), False
        # One at a time, from its parsing to its answer (parsed, it holds many times its
        # bytes), its size checked before it waits for a slot.
        if self._serving_large:
            raise _Refused("busy", "the server is serving another large request")
        self._serving_large = True
        try:
            document = await asyncio.to_thread(_parsed, line, checked=True)
            return self._request(document, role), True
        except BaseException:
            self._serving_large = False
            raise

    def _request(self, document: Any, role: str | None) -> dict[str, Any]:
        if not isinstance(document, dict) or set(document) != _REQUEST_KEYS:
            raise _Refused("bad_request", "a request line is an object of request and where")
        request, where = document["request"], Where.parse(document["where"])
        if not isinstance(request, dict) or where is None:
            raise _Refused("bad_request", "a request line is an object of request and where")
        request = _camel_case(request)
        if where != self._where:
            raise _Refused("elsewhere", "this server loads another policy file, tools or audit log")
        if role is not None:
            if request.get("role", role) != role:
                raise _Refused("role", f"this uid calls as {role} only")
            request["role"] = role
        self._no_person_here(request)
        return request

    def _no_person_here(self, request: dict[str, Any]) -> None:
        """A call the policy's ``approval:`` holds goes back to ``runner exec``, which asks on
        its own terminal: this server has nobody to ask."""
        policy, name, role = self._service.runner.policy, request.get("toolName"), request.get("role")
        tool = self._service.runner.registry.get(name) if isinstance(name, str) else None
        role = policy.resolve_role(role if isinstance(role, str) else None)
        if tool is not None and policy.approval_for(tool, role) is not None:
            raise _Refused("approval", "the call waits for a person's yes, asked on runner exec's terminal")

    async def _call_watching(
        self, reader: asyncio.StreamReader, sock: socket.socket, request: dict[str, Any], client: str
    ) -> dict[str, Any] | None:
        """The call's answer; None when the client went away first (the call is cancelled,
        its sandbox gone, before this returns)."""
        call = asyncio.ensure_future(self._service.call_for(request, client))
        gone = asyncio.ensure_future(_gone(reader, sock))
        try:
            done, _ = await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not call.done():
                call.cancel()
            await asyncio.gather(call, gone, return_exceptions=True)
        if call in done and not call.cancelled() and call.exception() is None:
            return call.result()
        return None


async def _gone(reader: asyncio.StreamReader, sock: socket.socket) -> None:
    """Until the client is gone: bytes it should not send, or its end closed whole. A
    client that only shut its writing side after the request (``nc -N``) still reads."""
    if await reader.read(1) != b"":
        return
    hung_up = select.poll()
    hung_up.register(sock.fileno(), select.POLLHUP)  # set once both sides are shut
    while not hung_up.poll(0):
        await asyncio.sleep(HANG_UP_POLL_S)


def _camel_case(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with its keys as this server reads them (``toolName``, not ``tool_name``,
    which the runner also takes): the slot and approval checks must see the tool it calls."""
    named: dict[str, Any] = {}
    for key, value in request.items():
        camel = to_camel(key) if isinstance(key, str) else key
        if camel in named:
            raise _Refused("bad_request", f"{camel} is given twice (camelCase and snake_case)")
        named[camel] = value
    return named


def _peer_uid(writer: asyncio.StreamWriter) -> int:
    sock = writer.get_extra_info("socket")
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return int(uid)


def _parsed(line: bytes, *, checked: bool = False) -> Any:
    """The request line's document; ``checked``: refused if its request is larger or
    deeper than the runner takes (as it would refuse it), so it never waits for a slot."""
    try:
        document = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise _Refused("bad_request", "the request line is not strict JSON") from None
    request = document.get("request") if checked and isinstance(document, dict) else None
    if isinstance(request, dict):
        try:
            check_json(request)
        except CallError as exc:  # anything else the call's own answer says, as for a short line
            if exc.details.get("problem") in ("too large", "too deep"):
                raise _Refused("too_large", exc.message) from None
    return document


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _line(document: dict[str, Any]) -> bytes:
    return json.dumps(document, ensure_ascii=True, allow_nan=False).encode() + b"\n"


class Alongside:
    """The socket beside the MCP transport: both serve until the MCP one ends (stdio: end of
    its input) or a stop."""

    def __init__(self, main: Transport, socket_transport: SocketTransport) -> None:
        self._main = main
        self._socket = socket_transport

    async def serve(self) -> None:
        side = asyncio.ensure_future(self._socket.serve())
        try:
            await self._main.serve()
        finally:
            self._socket.stop()
            await side

    def stop(self) -> None:
        self._main.stop()
        self._socket.stop()
