"""The longest stall of the event loop while sandboxes full of processes are torn down.

    python3 bench/loop_stall.py [--bombs 8] [--rounds 3]

A ticker task asks to wake every millisecond and records how late it wakes; meanwhile
``--bombs`` calls of a fork-bomb tool (``max_pids`` 64, a 1 s timeout) run and are torn
down at once, ``--rounds`` times. Baseline in the same run: the ticker alone. Goal: the
longest stall under the bombs stays at most 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runner import Runner  # noqa: E402

BOMB = """
import os, sys, time
sys.stdin.read()
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.001)
"""


async def ticker(stop: asyncio.Event, lateness: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        wanted = loop.time() + 0.001
        await asyncio.sleep(0.001)
        lateness.append(loop.time() - wanted)


async def measure(runner: Runner | None, bombs: int, rounds: int) -> list[float]:
    stop, lateness = asyncio.Event(), []
    ticking = asyncio.ensure_future(ticker(stop, lateness))
    if runner is None:
        await asyncio.sleep(2.0)
    else:
        for _ in range(rounds):
            results = await asyncio.gather(*(runner.acall("bomb", {}) for _ in range(bombs)))
            assert all(not r.success for r in results), "a fork bomb succeeded?"
    stop.set()
    await ticking
    return lateness


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bombs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        root.chmod(0o755)
        tool = root / "tools" / "bomb"
        tool.mkdir(parents=True)
        (tool / "main.py").write_text(textwrap.dedent(BOMB))
        manifest = {
            "name": "bomb",
            "description": "fork bomb",
            "command": ["python3", "main.py"],
            "parameters": {"type": "object"},
            "limits": {"timeout_ms": 1000, "max_pids": 64},
        }
        (tool / "tool.yaml").write_text(yaml.safe_dump(manifest))
        policy = {
            "version": 1,
            "default_role": "user",
            "whitelist": ["*"],
            "roles": {"user": {"allow": ["*"]}},
            "defaults": {"retries": 0, "deadline_ms": 10000},
            "circuit_breaker": {"failure_threshold": 1000, "reset_timeout_ms": 1000},
        }
        (root / "policies.yaml").write_text(yaml.safe_dump(policy))
        runner = Runner.load(tools=root / "tools", policies=root / "policies.yaml", audit_log=os.devnull)
        runner.call("bomb", {})  # first use: set-up off the measurement
        idle = asyncio.run(measure(None, 0, 0))
        started = time.perf_counter()
        loaded = asyncio.run(measure(runner, args.bombs, args.rounds))
        elapsed = time.perf_counter() - started
    for name, ticks in (("ticker alone", idle), (f"{args.bombs} fork bombs x {args.rounds} rounds", loaded)):
        p99 = sorted(ticks)[int(len(ticks) * 0.99)] * 1000
        longest = max(ticks) * 1000
        print(f"{name:<26} longest stall {longest:6.2f} ms, p99 {p99:5.2f} ms over {len(ticks)} ticks")
    print(f"({elapsed:.1f} s under the bombs; goal: longest stall <= 5 ms)")


if __name__ == "__main__":
    main()
