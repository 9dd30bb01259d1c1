"""End-to-end latency of one call, next to baselines measured in the same run.

    python3 bench/run.py [--n 30]

Baselines: a bare ``python3 main.py`` spawn of the same tool with the same payload, and
a bare ``bwrap`` around it (what namespaces alone cost). Measured: ``Runner.call``
(hardened sandbox: launcher, cgroup, namespaces, teardown) and the ``runner exec`` CLI
(interpreter start-up and imports included). The first three rows are sampled in turns
(one of each per round), so that drift in the machine's speed weighs on all alike.
Docker figures come from bench/docker_call.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import (  # noqa: E402
    ADD_PARAMS,
    ADD_PAYLOAD,
    PYTHON,
    bare_env,
    print_table,
    starter_folder,
    timed,
    timed_together,
)

from runner import Runner  # noqa: E402

STARTER = starter_folder()
TOOL = STARTER / "tools" / "add_numbers"
PARAMS, PAYLOAD = ADD_PARAMS, ADD_PAYLOAD
BARE_ENV = bare_env()


def bare() -> None:
    argv = [PYTHON, "main.py"]
    subprocess.run(argv, input=PAYLOAD, capture_output=True, cwd=TOOL, check=True, env=BARE_ENV)


def bare_bwrap() -> None:
    bwrap = shutil.which("bwrap")
    assert bwrap
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--proc", "/proc", "--dev", "/dev", "--ro-bind", str(TOOL), "/tool", "--chdir", "/tool",
            "--ro-bind", BARE_ENV["PYTHONPATH"], "/opt/runner/python",
            "--setenv", "PYTHONPATH", "/opt/runner/python",
            "--", PYTHON, "main.py"]  # fmt: skip
    subprocess.run(argv, input=PAYLOAD, capture_output=True, check=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=30)
    args = parser.parse_args()
    runner = Runner.load(tools=STARTER / "tools", policies=STARTER / "policies.yaml", audit_log=os.devnull)

    def runner_call() -> None:
        result = runner.call("add_numbers", PARAMS)
        assert result.success, result.error

    def runner_exec() -> None:
        env = {**os.environ, "RUNNER_AUDIT_LOG": os.devnull, "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [sys.executable, "-m", "runner", "exec", "add_numbers", "--params", json.dumps(PARAMS)],
            check=False,
            capture_output=True,
            cwd=STARTER,
            env=env,
        )
        assert done.returncode == 0, done.stderr

    # Taken in turns: the ratios hold on a machine whose speed drifts during the run.
    bare_ms, bwrap_ms, call_ms = timed_together([bare, bare_bwrap, runner_call], args.n)
    rows = [
        ("bare python3 main.py", bare_ms),
        ("bare bwrap + python3", bwrap_ms),
        ("Runner.call (hardened)", call_ms),
        ("runner exec (CLI)", timed(runner_exec, max(5, args.n // 3))),
    ]
    print_table(rows, baseline="bare")


if __name__ == "__main__":
    main()
