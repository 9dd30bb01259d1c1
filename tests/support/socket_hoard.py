"""Tools that pin host memory in loopback socket buffers, for both backends' hostile tests.

``SOCKET_HOARDER`` listens on its own sandbox's loopback, opens ``CONNECTIONS``
connections to itself and fills each one's queues without ever reading. The kernel lets
every socket keep a minimum past a cgroup's limit on socket memory, so what one socket
may hold does not matter: the number of sockets does. Without a stop, 4,000 connections
queue over 300 MB (cgroup v1), more than the call's ``memory_mb``.

``UNACCEPTED_HOARDER`` never accepts: a connection in an accept queue is charged to no
cgroup, and its receive queue holds up to the listener's ``SO_RCVBUF`` (twice the host's
``net.core.rmem_max``). It connects, sends until blocked and closes until ``target``
bytes wait behind its listener, then holds them a second.
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


UNACCEPTED_HOARDER = """
import json, socket, sys, time
sys.stdin.read()
target = int(sys.argv[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024 * 1024)  # as much as the host allows
server.bind(("127.0.0.1", 0))
server.listen(4096)
chunk, queued, connections = b"x" * 65536, 0, 0
while queued < target and connections < 2000:
    client = socket.create_connection(server.getsockname())
    client.setblocking(False)
    for _ in range(3):
        try:
            while True:
                queued += client.send(chunk)
        except BlockingIOError:
            time.sleep(0.005)
    client.close()  # what it sent waits in the accepted-by-nobody peer
    connections += 1
time.sleep(1)
json.dump({"connections": connections, "queued": queued}, sys.stdout)
"""


def assert_unaccepted_held(answer: dict[str, Any], memory_mb: int) -> None:
    """The call was stopped for memory, or it queued less than a quarter of ``memory_mb``."""
    if answer["success"]:
        assert answer["result"]["queued"] < memory_mb * MiB // 4, answer["result"]
    else:
        assert answer["error"]["code"] == "EXECUTION_ERROR", answer
        assert answer["error"]["details"]["reason"] == "memory_limit", answer
