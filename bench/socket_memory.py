"""How much host memory one call's loopback sockets pin, and how the call ends.

    python3 bench/socket_memory.py [--backend subprocess|docker] [--connections 4000] [--memory-mb 256]
        [--unaccepted]

The tool opens ``--connections`` connections to a listener on its own sandbox's loopback
and fills their queues without reading (the hostile tests' hoarder); with
``--unaccepted`` its listener asks for the largest receive buffer, never accepts, and
each connection sends until blocked and is closed (what it sent waits in a socket no
cgroup counts). While the call runs,
the host's ``/proc/net/sockstat`` is read every 2 ms: its ``TCP ... mem`` counts the pages
of every TCP socket buffer on the host (one count for all network namespaces; the
kernel's global ``tcp_mem`` is checked against it). The peak over the reading before the
call is what the call pinned; other TCP traffic on the host adds its own noise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runner import Runner  # noqa: E402

PAGE = 4096
MiB = 1024 * 1024
HOARDER = """
import json, resource, socket, sys
sys.stdin.read()
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
server = socket.create_server(("127.0.0.1", 0), backlog=1024)
chunk, held = b"x" * 65536, []
for _ in range(int(sys.argv[1])):
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    held += [client, peer]
    client.setblocking(False)
    try:
        while True:
            client.send(chunk)
    except BlockingIOError:
        pass
json.dump({"connections": len(held) // 2}, sys.stdout)
"""
UNACCEPTED = """
import json, socket, sys, time
sys.stdin.read()
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024 * 1024)
server.bind(("127.0.0.1", 0))
server.listen(4096)
for _ in range(int(sys.argv[1])):
    client = socket.create_connection(server.getsockname())
    client.setblocking(False)
    for _ in range(3):
        try:
            while True:
                client.send(b"x" * 65536)
        except BlockingIOError:
            time.sleep(0.005)
    client.close()
time.sleep(1)
json.dump({"connections": int(sys.argv[1])}, sys.stdout)
"""


def tcp_pages() -> int:
    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("TCP:"):
            fields = line.split()
            return int(fields[fields.index("mem") + 1])
    return 0


def write_tool(root: Path, backend: str, connections: int, memory_mb: int, code: str = HOARDER) -> Path:
    tools = root / "tools"
    folder = tools / "hoarder"
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    (folder / "main.py").write_text(code)
    manifest: dict[str, Any] = {
        "name": "hoarder", "description": "hoarder", "command": ["python3", "main.py", str(connections)],
        "parameters": {"type": "object"}, "limits": {"memory_mb": memory_mb, "timeout_ms": 60000},
    }  # fmt: skip
    if backend == "docker":
        manifest |= {"sandbox": "docker", "image": "runner/base:latest"}
    (folder / "tool.yaml").write_text(yaml.safe_dump(manifest))
    policy = {
        "version": 1, "default_role": "user", "whitelist": ["*"], "roles": {"user": {"allow": ["*"]}},
        "limits": {"timeout_ms": 60000, "memory_mb": memory_mb}, "defaults": {"retries": 0},
    }  # fmt: skip
    (root / "policies.yaml").write_text(yaml.safe_dump(policy))
    return tools


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("subprocess", "docker"), default="subprocess")
    parser.add_argument("--connections", type=int, default=4000)
    parser.add_argument("--memory-mb", type=int, default=256)
    parser.add_argument("--unaccepted", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        code = UNACCEPTED if args.unaccepted else HOARDER
        tools = write_tool(root, args.backend, args.connections, args.memory_mb, code)
        runner = Runner.load(tools=tools, policies=root / "policies.yaml", audit_log=root / "audit.log")
        baseline, peak, done = tcp_pages(), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tcp_pages())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        try:
            answer = runner.handle({"toolName": "hoarder", "options": {"timeout": 60000, "retries": 0}})
        finally:
            done.set()
            sampler.join()
            runner.close()
        error = answer.get("error") or {}
        ended = answer["result"] if answer["success"] else error["details"].get("reason", error["code"])
        print(
            json.dumps(
                {
                    "backend": args.backend,
                    "memory_mb": args.memory_mb,
                    "connections": args.connections,
                    "unaccepted": args.unaccepted,
                    "ended": ended,
                    "pinned_mb": round((peak[0] - baseline) * PAGE / MiB),
                    "seconds": round(time.monotonic() - started, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
