"""How fast the command line answers, next to a bare interpreter measured in the same run.

    python3 bench/cli_speed.py [--n 21] [--base CHECKOUT] [--exec-only] [--pool N]

Rows, each a fresh process: ``python3 -c pass`` (the floor every command pays),
``python3 -m runner --help``, ``runner exec add_numbers`` against the shipped tools (8) and
against 300 tools (the shipped ones plus generated ones, each with its own schema), all
end to end (interpreter, imports, loading the tools and the policy, the hardened sandbox,
the audit event); then ``runner exec add_numbers`` through ``runner serve --socket`` (a
server started for the run over the same 8 tools). ``python3 -c pass``, the direct and the
socket rows are taken in turns; ``--base CHECKOUT`` adds the direct row of another checkout
of the runner (an older commit, say) to those turns, and ``--exec-only`` leaves out the
other rows. Targets: exec at most 150 ms, --help at most 100 ms, exec
with 300 tools at most 1.2x exec with 8, exec through the socket at most 100 ms.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import print_table, starter_folder, timed, timed_together  # noqa: E402

MANY = 300
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
# No server for the direct rows: the default socket's folder is an empty one of the run's.
RUNTIME = tempfile.mkdtemp(prefix="runner-bench-xdg-")
atexit.register(shutil.rmtree, RUNTIME, ignore_errors=True)
ENV["XDG_RUNTIME_DIR"] = RUNTIME
ENV.pop("RUNNER_SOCKET", None)
SOCKET = "runner exec via socket"
TARGETS = {"runner --help": 100.0, "runner exec (8 tools)": 150.0, SOCKET: 100.0}
MAX_MANY_RATIO = 1.2

# A generated tool: its own name and a schema of its own (no two alike, so nothing can be
# shared between them) with the keywords real manifests use (pattern, enum, bounds, nested
# objects), so that checking it costs what a real one does.
_GENERATED = """\
name: gen_{i:03d}
description: Generated tool number {i} for the load benchmark
version: "1.0.0"
tags: [generated, bench]
command: ["python3", "main.py"]
sandbox: subprocess
parameters:
  type: object
  properties:
    query: {{type: string, minLength: 1, maxLength: {length}, pattern: "^[a-z0-9 ]+$"}}
    limit: {{type: integer, minimum: 1, maximum: {length}}}
    mode: {{enum: [fast, slow, exact]}}
    filters:
      type: object
      properties:
        tag: {{type: string}}
        since: {{type: string, format: date-time}}
      additionalProperties: false
  required: [query]
  additionalProperties: false
output_schema: {{type: object}}
limits:
  timeout_ms: 2000
"""


def many_tools_folder(starter: Path) -> Path:
    """A copy of the starter folder whose tools/ also holds generated tools, ``MANY`` in all."""
    folder = starter.parent / f"{starter.name}-many"
    shutil.copytree(starter, folder)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    tools = folder / "tools"
    shipped = sum(1 for path in tools.iterdir() if (path / "tool.yaml").is_file())
    main_py = (tools / "add_numbers" / "main.py").read_text()
    for i in range(MANY - shipped):
        tool = tools / f"gen_{i:03d}"
        tool.mkdir()
        (tool / "tool.yaml").write_text(_GENERATED.format(i=i, length=200 + i))
        (tool / "main.py").write_text(main_py)
    return folder


def command(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, check=False, capture_output=True, cwd=cwd, env=ENV)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-500:]}")


def runner_exec(folder: Path, env: dict[str, str] = ENV) -> None:
    argv = [sys.executable, "-m", "runner", "exec", "add_numbers", "--params", '{"a": 1, "b": 2}']
    done = subprocess.run(argv, check=False, capture_output=True, cwd=folder, env=env)
    answer = json.loads(done.stdout) if done.returncode == 0 else None
    if answer is None or answer["result"] != 3:
        raise SystemExit(f"runner exec failed ({done.returncode}): {done.stderr.decode()[-500:]}")


def start_server(folder: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``runner serve --socket`` over ``folder``, listening; stopped at exit."""
    run = Path(tempfile.mkdtemp(prefix="runner-bench-run-"))
    atexit.register(shutil.rmtree, run, ignore_errors=True)
    path = run / "serve.sock"
    argv = [sys.executable, "-m", "runner", "serve", "--socket", str(path)]
    server = subprocess.Popen(argv, cwd=folder, env=ENV, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(server.wait, 30)
    atexit.register(server.terminate)
    deadline = time.monotonic() + 120
    while not path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("runner serve --socket did not start")
        time.sleep(0.05)
    return server, path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=21)
    parser.add_argument("--base", type=Path, default=None, help="another checkout: its direct exec row too")
    parser.add_argument("--exec-only", action="store_true", help="only the rows taken in turns")
    parser.add_argument("--pool", type=int, default=0, help="warm sandboxes of add_numbers (the server's)")
    args = parser.parse_args()
    starter = starter_folder()  # its audit.log, workspace and tools, removed at exit
    policy_file = starter / "policies.yaml"
    policy = yaml.safe_load(policy_file.read_text())
    if args.pool:  # a one-shot runner exec starts none: only the server's calls use them
        policy.setdefault("tools", {}).setdefault("add_numbers", {})["pool"] = args.pool
    if args.base is not None:  # an older runner may not know every section (add_numbers needs none)
        policy.pop("approval", None)
    policy_file.write_text(yaml.safe_dump(policy))
    python, runner = [sys.executable, "-c", "pass"], [sys.executable, "-m", "runner", "--help"]
    rows = []
    if not args.exec_only:
        many = many_tools_folder(starter)
        rows += [
            ("runner --help", timed(lambda: command(runner, starter), args.n)),
            (f"runner exec ({MANY} tools)", timed(lambda: runner_exec(many), args.n)),
        ]
    _server, path = start_server(starter)
    socket_env = {**ENV, "RUNNER_SOCKET": str(path)}
    turns = {
        "python3 -c pass": lambda: command(python, starter),
        "runner exec (8 tools)": lambda: runner_exec(starter),
        SOCKET: lambda: runner_exec(starter, socket_env),
    }
    if args.base is not None:
        base_env = {**ENV, "PYTHONPATH": str(args.base.resolve())}
        turns["runner exec, --base"] = lambda: runner_exec(starter, base_env)
    rows = list(zip(turns, timed_together(list(turns.values()), args.n), strict=True)) + rows
    print_table(rows, baseline="python3")
    medians = {name: statistics.median(samples) for name, samples in rows}
    print()
    if not args.exec_only:
        ratio = medians[f"runner exec ({MANY} tools)"] / medians["runner exec (8 tools)"]
        print(f"{MANY} tools / 8 tools: {ratio:.2f}x (target <= {MAX_MANY_RATIO}x)")
    if args.base is not None:
        direct = medians["runner exec (8 tools)"] / medians["runner exec, --base"]
        print(f"direct exec / --base's: {direct:.2f}x (target <= 1.0x within noise)")
    for name, target in TARGETS.items():
        if name not in medians:
            continue
        verdict = "ok" if medians[name] <= target else "OVER"
        print(f"{name}: {medians[name]:.0f} ms (target <= {target:.0f} ms) {verdict}")


if __name__ == "__main__":
    main()
