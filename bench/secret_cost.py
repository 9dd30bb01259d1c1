"""What secrets cost: a call without and with one (each backend), and the scrubbing of a
large output on its own.

    python3 bench/secret_cost.py [--n 15] [--docker]

The same tool in every row; with a secret it is granted one (an environment variable
source) and its stdout, stderr and audit events are searched for it after every attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import print_table, timed  # noqa: E402

from runner import Runner  # noqa: E402
from runner.schema.redaction import Scrubber  # noqa: E402
from runner.secrets.output import scrub_outcome  # noqa: E402
from sandboxes import SandboxOutcome  # noqa: E402

CODE = "import json, sys\np = json.load(sys.stdin)['params']\njson.dump(p['a'] + p['b'], sys.stdout)\n"
MANIFEST = "description: add\ncommand: [python3, main.py]\nparameters: {type: object}\n"
POLICY = (
    "version: 1\ndefault_role: u\nwhitelist: ['*']\nroles: {u: {allow: ['*']}}\n"
    "secrets: {TOKEN: {env: BENCH_TOKEN}}\n"
    "tools: {plain_docker: {}, secret: {secrets: [TOKEN]}, secret_docker: {secrets: [TOKEN]}}\n"
)
DOCKER = "sandbox: docker\nimage: runner/base:latest\n"


def write_tools(root: Path) -> None:
    for name, extra in (
        ("plain", ""),
        ("secret", "secrets: [TOKEN]\n"),
        ("plain_docker", DOCKER),
        ("secret_docker", DOCKER + "secrets: [TOKEN]\n"),
    ):
        folder = root / name.replace("_", "-")
        folder.mkdir(parents=True)
        (folder / "main.py").write_text(CODE)
        (folder / "tool.yaml").write_text(f"name: {name}\n{MANIFEST}{extra}")


def scrub_ms(stdout: bytes, output_format: str, secrets: int) -> float:
    scrubber = Scrubber(frozenset(f"sk-{i:04d}-{'x' * 32}" for i in range(secrets)))
    outcome = SandboxOutcome(0, None, stdout, "e" * 8192, 0.0)
    started = time.perf_counter()
    scrub_outcome(outcome, scrubber, "json" if output_format == "json" else "raw")
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=15)
    parser.add_argument("--docker", action="store_true")
    args = parser.parse_args()
    os.environ["BENCH_TOKEN"] = "sk-bench-" + "x" * 40
    with tempfile.TemporaryDirectory() as tmp:
        write_tools(Path(tmp) / "tools")
        policy = Path(tmp) / "policies.yaml"
        policy.write_text(POLICY)
        runner = Runner.load(tools=Path(tmp) / "tools", policies=policy, audit_log=os.devnull)

        def call(name: str) -> None:
            result = runner.call(name, {"a": 1, "b": 2}, retries=0, timeout=20000, deadline=25000)
            assert result.success, result.error

        names = ["plain", "secret"] + (["plain_docker", "secret_docker"] if args.docker else [])
        rows = [(name, timed(lambda name=name: call(name), args.n)) for name in names]
        runner.close()
    print_table(rows, "plain")
    # ~1 MiB each; a backslash in the JSON (here "\n") means it must be parsed to be searched.
    plain = json.dumps([{"k": "v" * 100, "n": i} for i in range(9000)]).encode()
    escaped = json.dumps([{"k": "v" * 99 + "\n", "n": i} for i in range(9000)]).encode()
    print(f"\nscrubbing one {len(plain) // 1024} KiB stdout (ms, best of 5):")
    for label, document, output_format in (
        ("json", plain, "json"),
        ("json+\\n", escaped, "json"),
        ("raw", plain, "raw"),
    ):
        for secrets in (1, 20):
            best = min(scrub_ms(document, output_format, secrets) for _ in range(5))
            print(f"  {label:<8} {secrets:>2} secret(s): {best:7.1f}")


if __name__ == "__main__":
    main()
