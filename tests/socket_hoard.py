"""A tool that pins host memory in loopback socket buffers, for both backends' hostile tests.

It listens on its own sandbox's loopback, opens ``CONNECTIONS`` connections to itself and
fills each one's queues without ever reading. The kernel lets every socket keep a minimum
past a cgroup's limit on socket memory, so what one socket may hold does not matter: the
number of sockets does. Without a stop, 4,000 connections queue over 300 MB (cgroup v1),
more than the call's ``memory_mb``.
"""

from __future__ import annotations

from typing import Any

CONNECTIONS = 4000
MiB = 1024 * 1024

SOCKET_HOARDER = f"""
import json, resource, socket, sys
sys.stdin.read()
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
server = socket.create_server(("127.0.0.1", 0), backlog=1024)
chunk, held = b"x" * 65536, []
for _ in range({CONNECTIONS}):
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    held += [client, peer]  # the peer never reads: everything stays queued
    client.setblocking(False)
    try:
        while True:
            client.send(chunk)
    except BlockingIOError:
        pass

queued = 0  # bytes in the send and receive queues of every TCP socket of this sandbox
for row in open("/proc/net/tcp").read().splitlines()[1:]:
    tx, rx = row.split()[4].split(":")
    queued += int(tx, 16) + int(rx, 16)
json.dump({{"connections": len(held) // 2, "queued": queued}}, sys.stdout)
"""


def assert_sockets_held(answer: dict[str, Any], memory_mb: int) -> None:
    """The call was stopped for memory, or it made every connection and queued less than a
    quarter of ``memory_mb`` (the share its sockets get)."""
    if answer["success"]:
        result = answer["result"]
        assert result["connections"] == CONNECTIONS, result
        assert result["queued"] < memory_mb * MiB // 4, result
    else:
        assert answer["error"]["code"] == "EXECUTION_ERROR", answer
        assert answer["error"]["details"]["reason"] == "memory_limit", answer
