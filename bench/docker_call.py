"""Latency of a docker tool through the runner next to ``docker run --rm -i``.

    python3 bench/docker_call.py [--n 15]

Same image (runner/base:latest), same command, same payload, same limits flags, in the
same run. The runner talks to the daemon through the SDK (create, attach, start, wait,
remove); the baseline pays for the docker CLI process as well.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import docker_add_folder, docker_run_argv, print_table, timed  # noqa: E402

from runner import Runner  # noqa: E402

PAYLOAD = json.dumps(
    {"params": {"a": 1, "b": 2}, "context": {"requestId": "b", "toolName": "add", "attempt": 1}}
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tools, policy = docker_add_folder(Path(tmp))
        tool = tools / "dadd"
        runner = Runner.load(tools=tools, policies=policy, audit_log=os.devnull)

        def through_runner() -> None:
            result = runner.call("dadd", {"a": 1, "b": 2}, retries=0)
            assert result.success, result.error

        cli = docker_run_argv(tool)

        def docker_run() -> None:
            done = subprocess.run(cli, check=False, input=PAYLOAD.encode(), capture_output=True)
            assert done.stdout.strip() == b"3", done.stderr

        rows = [
            ("docker run --rm -i", timed(docker_run, args.n)),
            ("Runner.call (docker)", timed(through_runner, args.n)),
        ]
    print_table(rows, baseline="docker run")


if __name__ == "__main__":
    main()
