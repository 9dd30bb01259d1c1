"""A real ``runner serve --socket`` over a starter folder, and the raw client of its protocol."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.config.starter import write_starter

START_S = 60.0  # the machine is shared and loaded: loading the runner may take a while


@dataclass
class Served:
    folder: Path  # the starter folder: policies.yaml, tools/, audit.log
    socket: Path
    process: subprocess.Popen[bytes]

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "RUNNER_SOCKET": str(self.socket), **extra}

    def audit(self) -> list[dict[str, Any]]:
        path = self.folder / "audit.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def finished(self, request_id: str) -> dict[str, Any]:
        """The ``call.finished`` event of ``request_id``."""
        found = [
            e for e in self.audit() if e.get("event") == "call.finished" and e.get("requestId") == request_id
        ]
        assert len(found) == 1, found
        return found[0]


def starter(folder: Path, policy_extra: str = "") -> Path:
    """A ``runner init`` folder; ``policy_extra`` is appended to its policy."""
    folder.mkdir(parents=True, exist_ok=True)
    write_starter(folder)
    if policy_extra:
        with (folder / "policies.yaml").open("a") as policy:
            policy.write(policy_extra)
    return folder


def start(folder: Path, socket_path: Path, *args: str, prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """``runner serve --socket`` on ``folder`` (``prefix``: a command to run it under)."""
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "runner", "serve", "--socket", str(socket_path), *args],
        cwd=folder,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@contextmanager
def serving(folder: Path, socket_path: Path, *args: str) -> Iterator[Served]:
    """The server, up (its socket answers) until the block ends; then stopped with SIGTERM."""
    process = start(folder, socket_path, *args)
    try:
        deadline = time.monotonic() + START_S
        while not _answers(socket_path):
            if process.poll() is not None:
                raise AssertionError(f"serve exited {process.returncode}: {process.stderr.read()!r}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise AssertionError("serve did not listen in time")
            time.sleep(0.1)
        yield Served(folder, socket_path, process)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def where_of(folder: Path) -> dict[str, Any]:
    """The ``where`` of a call that loads ``folder``'s policy and tools."""
    return {  # resolved, as a client sends them
        "policies": os.path.realpath(folder / "policies.yaml"),
        "tools": [os.path.realpath(folder / "tools")],
        "auditLog": None,
    }


def exchange(path: Path, data: bytes, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """Send ``data`` raw, return the one line the server answers (None: it closed without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(str(path))
        # Refused (busy) before its request was read, the send may break: the refusal
        # still waits to be read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(data)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    return json.loads(reply) if reply else None
