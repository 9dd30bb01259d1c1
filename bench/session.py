"""Sessions: a call in a warm session sandbox next to a warm pooled call, in one run.

    python3 bench/session.py [--n 200]

The shipped ``add_numbers`` with ``tools.add_numbers: {pool: 2, session: true}``: calls
outside a session take a warm pooled sandbox, calls in a session run in the session's
sandbox (opened by an untimed first call). Rows, sampled in turns after a bare
``python3 main.py`` spawn (the baseline): the warm pooled ``Runner.acall`` (each made once
the pool is full again and 50 ms more, as ``bench/pool.py`` does) and ``Session.acall``
in the warm session.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import ADD_PARAMS, ADD_PAYLOAD, PYTHON, bare_env, print_table, starter_folder, timed_together  # noqa: E402

from runner import Runner  # noqa: E402

STARTER = starter_folder()
TOOL = STARTER / "tools" / "add_numbers"
POOL_SIZE = 2
CALL_GAP_S = 0.05
BARE_ENV = bare_env()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    n = parser.parse_args().n
    policy = yaml.safe_load((STARTER / "policies.yaml").read_text())
    policy.setdefault("tools", {})["add_numbers"] = {"pool": POOL_SIZE, "session": True}
    path = STARTER / "policies-session.yaml"
    path.write_text(yaml.safe_dump(policy))
    audit = Path(tempfile.mkdtemp(prefix="runner-bench-")) / "audit.log"
    runner = Runner.load(tools=STARTER / "tools", policies=path, audit_log=audit)
    loop = asyncio.new_event_loop()
    session = runner.session().start()

    def bare() -> None:
        argv = [PYTHON, "main.py"]
        subprocess.run(argv, input=ADD_PAYLOAD, capture_output=True, cwd=TOOL, check=True, env=BARE_ENV)

    def pooled() -> None:
        answer = loop.run_until_complete(runner.acall("add_numbers", ADD_PARAMS))
        assert answer.success and answer.result == 3, answer

    def in_session() -> None:
        answer = loop.run_until_complete(session.acall("add_numbers", ADD_PARAMS))
        assert answer.success and answer.result == 3, answer

    def pool_full() -> None:
        deadline = time.monotonic() + 10
        while runner.warm_sandboxes().get("add_numbers", 0) < POOL_SIZE:
            if time.monotonic() > deadline:
                raise SystemExit("the pool did not fill within 10 s")
            time.sleep(0.002)
        time.sleep(CALL_GAP_S)

    try:
        in_session()  # opens the session's sandbox
        samples = timed_together([bare, pooled, in_session], n, before=pool_full)
    finally:
        loop.run_until_complete(session.aclose())
        loop.run_until_complete(runner.aclose())
        loop.close()
    print(f"n={n}, load {os.getloadavg()[0]:.1f}")
    rows = ["bare python3 main.py", "Runner.acall, warm pool", "Session.acall, warm session"]
    print_table(list(zip(rows, samples, strict=True)), "bare")
    events = audit.read_text().count('"warm":true')
    print(f"pooled calls that found a warm sandbox: {events} of {n + 1}")


if __name__ == "__main__":
    main()
