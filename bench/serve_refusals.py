"""What a client without a token makes ``runner serve --http`` write: requests refused
(401) per second from one process, and how much the audit log grows.

    python3 bench/serve_refusals.py [--seconds 5] [--workers 16]

The server runs the shipped starter policy with a chained audit log of its own; the
client sends POSTs without a token (or with a made-up one) for the given time. The log's
growth is read while the server runs and again after it stopped (which writes the last
summaries).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx2  # noqa: E402
import yaml  # noqa: E402
from _timing import starter_folder  # noqa: E402

PING = {"jsonrpc": "2.0", "id": 1, "method": "ping"}


async def flood(url: str, seconds: float, workers: int) -> int:
    sent = 0
    until = time.monotonic() + seconds
    async with httpx2.AsyncClient(timeout=30, limits=httpx2.Limits(max_connections=workers)) as http:

        async def worker() -> None:
            nonlocal sent
            while time.monotonic() < until:
                headers = {"Authorization": "Bearer rnr_guess"} if sent % 2 else {}
                answer = await http.post(url, json=PING, headers=headers)
                assert answer.status_code == 401, answer.status_code
                sent += 1

        await asyncio.gather(*(worker() for _ in range(workers)))
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-refusals-") as scratch:
        root, starter = Path(scratch), starter_folder()
        policy = yaml.safe_load((starter / "policies.yaml").read_text())
        policy["audit"] = {**policy.get("audit", {}), "chain": True, "path": None}
        (root / "policies.yaml").write_text(yaml.safe_dump(policy))
        audit = root / "audit.log"
        argv = [sys.executable, "-m", "runner", "--tools", str(starter / "tools")]
        argv += ["--policies", str(root / "policies.yaml"), "--audit-log", str(audit)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        argv += ["serve", "--http", "127.0.0.1:0"]
        server = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
        assert server.stderr is not None
        try:
            url = ""
            while "serving MCP at " not in url:
                ready, _, _ = select.select([server.stderr], [], [], 120)
                assert ready, "the server did not start"
                url = server.stderr.readline()
            url = url.split("serving MCP at ", 1)[1].strip()
            before = audit.stat().st_size if audit.exists() else 0
            started = time.monotonic()
            sent = asyncio.run(flood(url, args.seconds, args.workers))
            elapsed = time.monotonic() - started
            running = audit.stat().st_size - before
        finally:
            server.terminate()
            server.wait(timeout=60)
        after = audit.stat().st_size - before
        lines = [line for line in audit.read_text().splitlines() if '"serve.auth"' in line]
    print(f"refused requests: {sent} in {elapsed:.1f} s ({sent / elapsed:.0f}/s, {args.workers} at once)")
    print(f"audit log growth while serving: {running} bytes ({running / elapsed:.0f} bytes/s)")
    print(f"after the server stopped: {after} bytes, {len(lines)} serve.auth events")


if __name__ == "__main__":
    main()
