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

from _timing import print_table, timed  # noqa: E402

from runner import Runner  # noqa: E402

CODE = "import json, sys\np = json.load(sys.stdin)['params']\njson.dump(p['a'] + p['b'], sys.stdout)\n"
PAYLOAD = json.dumps(
    {"params": {"a": 1, "b": 2}, "context": {"requestId": "b", "toolName": "add", "attempt": 1}}
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tool = Path(tmp) / "tools" / "dadd"
        tool.mkdir(parents=True)
        (tool / "main.py").write_text(CODE)
        (tool / "tool.yaml").write_text(
            "name: dadd\ndescription: add in docker\ncommand: [python3, main.py]\n"
            "sandbox: docker\nimage: runner/base:latest\nparameters: {type: object}\n"
        )
        policy = Path(tmp) / "policies.yaml"
        policy.write_text("version: 1\ndefault_role: u\nwhitelist: ['*']\nroles: {u: {allow: ['*']}}\n")
        runner = Runner.load(tools=Path(tmp) / "tools", policies=policy, audit_log=os.devnull)

        def through_runner() -> None:
            result = runner.call("dadd", {"a": 1, "b": 2}, retries=0)
            assert result.success, result.error

        cli = [
            "docker", "run", "--rm", "-i", "--network", "none", "--read-only", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--user", "65534:65534", "--init",
            "--tmpfs", "/tmp:size=64m", "--memory", "256m", "--memory-swap", "256m", "--pids-limit", "64",
            "-v", f"{tool}:/tool:ro", "-w", "/tool", "runner/base:latest", "python3", "main.py",
        ]  # fmt: skip

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
