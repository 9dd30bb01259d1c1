"""Runners to be killed: forks ``runners`` runner processes at once, each calling a tool
over and over (two calls at a time), and SIGKILLs each at a random moment.

Used by ``test_kill_guarantee.py``: ``python3 kill_harness.py TOOLS POLICIES TOOL ROUNDS
RUNNERS MAX_DELAY_MS``. For each round it prints one JSON line once every runner of the
round is dead: their pids, the time of the last kill and the time the last of them was
reaped (``time.monotonic()``); then it waits for a line on stdin before the next round.
With ``KILL_SESSIONS=1`` each runner makes its calls in two open sessions as well as
outside them (the tool then being a session tool, by the policy).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from runner import Runner


def spin(runner: Runner, tool: str) -> None:
    """A runner's life: calls, forever, until it is killed."""
    counter = itertools.count()

    async def caller(call: Callable[..., Awaitable[object]]) -> None:
        while True:
            await call(tool, {}, request_id=f"kill-{os.getpid()}-{next(counter)}")

    async def main() -> None:
        if os.environ.get("KILL_SESSIONS") != "1":
            await asyncio.gather(caller(runner.acall), caller(runner.acall))
            return
        async with runner.session() as first, runner.session() as second:
            await asyncio.gather(caller(first.acall), caller(second.acall), caller(runner.acall))

    asyncio.run(main())


def main(argv: list[str]) -> int:
    tools, policies, tool = argv[1], argv[2], argv[3]
    rounds, runners, max_delay = int(argv[4]), int(argv[5]), int(argv[6]) / 1000
    runner = Runner.load(tools=tools, policies=policies, audit_log=os.devnull)
    rng = random.Random(int(os.environ.get("KILL_SEED", "0")) or None)
    for _ in range(rounds):
        pids = []
        for _ in range(runners):
            pid = os.fork()
            if pid == 0:
                try:
                    spin(runner, tool)
                finally:
                    os._exit(0)
            pids.append(pid)
        started = time.monotonic()
        kills = sorted((rng.uniform(0, max_delay), pid) for pid in pids)
        for at, pid in kills:
            time.sleep(max(0.0, started + at - time.monotonic()))
            os.kill(pid, signal.SIGKILL)
        last_kill = time.monotonic()
        for pid in pids:
            os.waitpid(pid, 0)
        # A runner is dead once it is reaped: a SIGKILLed process whose thread sits in an
        # uninterruptible kernel call (a v1 cgroup migration waits out an RCU grace
        # period) takes that long to exit, and only then do its descriptors close.
        last_death = time.monotonic()
        print(json.dumps({"pids": pids, "last_kill": last_kill, "last_death": last_death}), flush=True)
        # The next round starts only once the test has looked for this round's leftovers.
        if not sys.stdin.readline():
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
