"""``runner exec`` through ``runner serve --socket``, with the standard library alone.

The call is forwarded only when the answer is sure to be the one the direct path would
print: every argument is one this module reads exactly as the full command line does (the
options of ``runner exec`` but ``--tools``, ``--policies``, ``--audit-log``, ``--help``, a
request on stdin, and ``--params @-``), standard output is not a terminal (a person gets the
full command line's readable format), and the server loads the same policy file, tool
folders and audit log as this call would (the server checks; the request line says which).
Otherwise, and whenever the server does not take the call (none listens, it refuses this
uid, it is shutting down), ``forward`` returns and the call runs here. Once the server has
the call, its answer is printed as is and decides the exit status (0 success, 1 failure).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from runner.config.locations import found_policy, tool_dirs
from runner.config.sockets import MAX_REQUEST_BYTES, SOCKET_ENV, default_socket, is_own_socket

CONNECT_S = 1.0  # a server that cannot take a connection in this long is not used
_PEERCRED = struct.Struct("3i")
_INTEGERS = {"--timeout": 1, "--retries": 0, "--retry-delay": 0, "--deadline": 1}  # and their minimum
_TEXTS = ("--params", "--role", "--format", "--request-id", "--step-id")
_FORMATS = ("json", "raw")


def forward(args: list[str]) -> None:
    """Send ``runner exec ARGS`` to the local server and exit with its answer; return when
    the call is to run here instead."""
    if sys.stdout.isatty() or sys.stderr.isatty():
        return  # a person reads it: the full command line's readable answer, progress and log lines
    given = _parse(args)
    if given is None:
        return
    request = _request(given)
    where = _where()
    if request is None or where is None:
        return
    try:
        line = json.dumps({"request": request, "where": where}, ensure_ascii=True, allow_nan=False)
    except ValueError:  # NaN or Infinity in the params: the full path answers for them
        return
    data = line.encode() + b"\n"
    if len(data) > MAX_REQUEST_BYTES:
        return
    explicit = os.environ.get(SOCKET_ENV)
    path = Path(explicit) if explicit else default_socket()
    if not explicit and not is_own_socket(path):
        return
    answer = _exchange(path, data, same_user=not explicit)
    if answer is None:
        return
    sys.stdout.write(json.dumps(answer, ensure_ascii=True, allow_nan=False) + "\n")
    sys.stdout.flush()
    sys.exit(0 if answer.get("success") is True else 1)


def _parse(args: list[str]) -> dict[str, str] | None:
    """The arguments by option name (``TOOL`` under ``""``); None when any is not one this
    module reads as the full command line would."""
    given: dict[str, str] = {}
    rest = iter(args)
    for arg in rest:
        if arg == "--direct":
            return None
        name, sep, value = arg.partition("=")
        if name in _TEXTS or name in _INTEGERS:
            if not sep:
                value = next(rest, "-")
            if name in given or value.startswith("-"):
                return None  # repeated, missing, or a value that looks like an option
            given[name] = value
        elif arg.startswith("-") or "" in given:
            return None  # an option read only by the full command line, `-` (stdin) or a second TOOL
        else:
            given[""] = arg
    if "" not in given:
        return None
    for name, least in _INTEGERS.items():
        number = given.get(name)
        if number is not None and not (number.isascii() and number.isdigit() and int(number) >= least):
            return None
    if given.get("--format", "json") not in _FORMATS:
        return None
    return given


def _request(given: dict[str, str]) -> dict[str, Any] | None:
    """The request ``runner exec`` builds from the same arguments; None when the params
    cannot be read (the full path says why)."""
    params = _params(given.get("--params"))
    if params is None:
        return None
    options = {
        "timeout": given.get("--timeout"),
        "retries": given.get("--retries"),
        "retryDelay": given.get("--retry-delay"),
        "deadline": given.get("--deadline"),
        "format": given.get("--format"),
    }
    request: dict[str, Any] = {
        "toolName": given[""],
        "params": params[0],
        "options": {
            key: value if key == "format" else int(value)
            for key, value in options.items()
            if value is not None
        },
    }
    for key, name in (("role", "--role"), ("requestId", "--request-id"), ("stepId", "--step-id")):
        if name in given:
            request[key] = given[name]
    return request


def _params(value: str | None) -> tuple[object] | None:
    """The params, in a tuple (they may well be JSON null); None when they cannot be read."""
    if value is None:
        return ({},)
    if value == "@-":
        return None  # stdin is read once, by the path that runs the call
    text = value
    if value.startswith("@"):
        try:
            with Path(value[1:]).open("rb") as source:  # bounded: @/dev/zero
                data = source.read(MAX_REQUEST_BYTES + 1)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        if len(data) > MAX_REQUEST_BYTES:
            return None
    try:
        return (json.loads(text),)
    except (ValueError, RecursionError):
        return None


def _where() -> dict[str, Any] | None:
    """The policy file, tool folders and audit log this call would load."""
    policy = found_policy(None)
    if policy is None:
        return None
    audit_log = os.environ.get("RUNNER_AUDIT_LOG") or None
    # Resolved here: the server compares them with its own resolved paths as they are.
    return {
        "policies": os.path.realpath(policy),
        "tools": [os.path.realpath(folder) for folder in tool_dirs(None, policy)],
        "auditLog": None if audit_log is None else os.path.realpath(audit_log),
    }


def _exchange(path: Path, data: bytes, *, same_user: bool) -> dict[str, Any] | None:
    """The server's answer; None when it did not take the call. Exits 1 when it took the
    call and gave no answer, 130 on Ctrl-C (closing the connection cancels the call)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_S)
        try:
            conn.connect(str(path))
            if same_user and _peer_uid(conn) != os.getuid():
                return None
            conn.settimeout(None)
            conn.sendall(data)
        except OSError:
            return None  # no server, or one that stopped reading before the whole line: not run
        try:
            reply = _read_line(conn)
        except KeyboardInterrupt:
            sys.exit(130)
        except OSError:
            reply = b""
    finally:
        conn.close()
    try:
        document = json.loads(reply)
    except ValueError:
        document = None
    answer = document.get("answer") if isinstance(document, dict) else None
    if isinstance(answer, dict):
        return answer
    if isinstance(document, dict) and "refused" in document:
        return None
    sys.stderr.write(f"runner: the server at {path} took the call but sent no answer (see its log)\n")
    sys.exit(1)


def _read_line(conn: socket.socket) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


def _peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return int(uid)
