"""CPU per call, the whole machine's: what bounds throughput on a machine's cores.

    python3 bench/call_cpu.py [--rounds 20] [--batch 10]

Counts the machine's busy time (``/proc/stat``: every process and the kernel's own
workers, not only this one) over batches of one-at-a-time calls of the shipped
``add_numbers``, the rows taken in turns, batch by batch, so that a drift in the
machine's speed weighs on all alike:

- a bare ``python3 main.py`` spawn (the baseline);
- a cold ``Runner.call`` of a tool folder the sandbox user cannot reach (a ``mkdtemp``
  folder, as root): bound once in the launch thread's namespace;
- the same, staged the older way, by the launcher for each call (``unshare`` + ``mount``);
- a cold ``Runner.call`` of a tool folder anyone can reach (bound directly).

The last column is the bare spawn's CPU over the row's: about the throughput ratio the
cores allow (``bench/load.py`` measures that ratio itself).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import ADD_PAYLOAD, PYTHON, bare_env, starter_folder  # noqa: E402

from runner import Runner  # noqa: E402
from sandboxes.subprocess import _command, sandbox  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU time the machine has spent on anything but idling, since boot."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICKS  # idle, iowait


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10)
    args = parser.parse_args()
    starter = starter_folder()
    tool = starter / "tools" / "add_numbers"
    env = bare_env()
    runner = Runner.load(tools=starter / "tools", policies=starter / "policies.yaml", audit_log=os.devnull)
    launch_thread = sandbox.SubprocessSandbox._stage_id

    def bare() -> None:
        argv = [PYTHON, "main.py"]
        subprocess.run(argv, input=ADD_PAYLOAD, capture_output=True, cwd=tool, check=True, env=env)

    def call() -> None:
        answer = runner.call("add_numbers", {"a": 1, "b": 2})
        assert answer.success and answer.result == 3, answer

    def setting(mode: int, staging: Callable[..., object]) -> Callable[[], None]:
        def apply() -> None:
            starter.chmod(mode)
            _command.reachable_by_others.cache_clear()
            sandbox.SubprocessSandbox._stage_id = staging  # type: ignore[method-assign,assignment]

        return apply

    rows: list[tuple[str, Callable[[], None], Callable[[], None]]] = [
        ("bare python3 main.py", bare, lambda: None),
        ("call, bound once (launch thread)", call, setting(0o700, launch_thread)),
        ("call, staged by the launcher", call, setting(0o700, lambda *_, **__: None)),
        ("call, folder anyone can reach", call, setting(0o755, launch_thread)),
    ]
    spent = dict.fromkeys((name for name, _, _ in rows), 0.0)
    for _, fn, apply in rows:  # warm-up: caches, the launch thread, the binds
        apply()
        fn()
    try:
        for _ in range(args.rounds):
            for name, fn, apply in rows:
                apply()
                before = busy_seconds()
                for _ in range(args.batch):
                    fn()
                spent[name] += busy_seconds() - before
    finally:
        runner.close()
    calls = args.rounds * args.batch
    bare_ms = spent[rows[0][0]] / calls * 1000
    print(f"{calls} calls per row, one at a time, {os.cpu_count()} cores; machine CPU per call:")
    for name, total in spent.items():
        ms = total / calls * 1000
        print(f"{name:36s} {ms:6.1f} ms   bare/this {bare_ms / ms:5.2f}")


if __name__ == "__main__":
    main()
