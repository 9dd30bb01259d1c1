"""Docker sessions: a call in a warm session container next to a warm pooled docker call
and a cold one, in one run.

    python3 bench/docker_session.py [--n 30]

The docker tool ``dadd`` with ``tools.dadd: {pool: 2, session: true}``: calls outside a
session take a warm pooled container, calls in a session are a ``docker exec`` in the
session's container (opened by an untimed first call). Rows, sampled in turns: the cold
call (``pool: 0`` in a second runner, the baseline), the warm pooled ``Runner.acall``
(each made once the pool is full again and 50 ms more) and ``Session.acall``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import docker_add_folder, print_table, timed_together  # noqa: E402

from runner import Runner  # noqa: E402

POOL_SIZE = 2
CALL_GAP_S = 0.05
PARAMS = {"a": 1, "b": 2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=30)
    n = parser.parse_args().n
    with tempfile.TemporaryDirectory() as tmp:
        tools, policy = docker_add_folder(Path(tmp), f"{{dadd: {{pool: {POOL_SIZE}, session: true}}}}")
        _, cold_policy = docker_add_folder(Path(tmp) / "cold")
        runner = Runner.load(tools=tools, policies=policy, audit_log=os.devnull)
        cold_runner = Runner.load(tools=tools, policies=cold_policy, audit_log=os.devnull)
        loop = asyncio.new_event_loop()
        session = runner.session().start()

        def check(answer: object) -> None:
            assert getattr(answer, "success", False), answer

        def cold() -> None:
            check(loop.run_until_complete(cold_runner.acall("dadd", PARAMS)))

        def pooled() -> None:
            check(loop.run_until_complete(runner.acall("dadd", PARAMS)))

        def in_session() -> None:
            check(loop.run_until_complete(session.acall("dadd", PARAMS)))

        def pool_full() -> None:
            deadline = time.monotonic() + 30
            while runner.warm_sandboxes().get("dadd", 0) < POOL_SIZE:
                if time.monotonic() > deadline:
                    raise SystemExit("the pool did not fill within 30 s")
                time.sleep(0.005)
            time.sleep(CALL_GAP_S)

        try:
            in_session()  # opens the session's container
            samples = timed_together([cold, pooled, in_session], n, before=pool_full)
        finally:
            loop.run_until_complete(session.aclose())
            loop.run_until_complete(runner.aclose())
            loop.run_until_complete(cold_runner.aclose())
            loop.close()
    print(f"n={n}, load {os.getloadavg()[0]:.1f}")
    rows = ["Runner.acall, cold container", "Runner.acall, warm pool", "Session.acall, warm session"]
    print_table(list(zip(rows, samples, strict=True)), "Runner.acall, cold")


if __name__ == "__main__":
    main()
