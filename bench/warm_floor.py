"""The floor of a warm call: where its time goes, next to the parts it is made of.

    python3 bench/warm_floor.py [--n 100] [--profile]

Rows, sampled in turns (one of each per round): ``true`` spawned bare (a fork and exec),
the same ``true`` under ``bwrap`` with fresh namespaces (bubblewrap and its init),
``python3 -c pass`` (the interpreter's start and exit alone), a bare ``python3 main.py``
of ``add_numbers``, and a warm ``Runner.call`` of it (``pool: 2``; each call made once the
pool is full again and 50 ms more, as in ``bench/pool.py``). For the warm call, also the
runner's own CPU per call: the calling thread's (its event loop: the guard, the audit,
the sandbox's pipes and teardown) and the whole process's (the validation threads too).
With ``--profile``, the runner's functions that took the most of it (cProfile of the
calling thread over the warm calls, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import ADD_PARAMS, ADD_PAYLOAD, PYTHON, bare_env, print_table, timed_together  # noqa: E402
from pool import POOL_SIZE, STARTER, runner, wait_full  # noqa: E402

TOOL = STARTER / "tools" / "add_numbers"
BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
BWRAP_ARGV = [
    BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all", "--die-with-parent",
]  # fmt: skip


def spawn(argv: list[str], payload: bytes = b"", cwd: Path | None = None) -> None:
    subprocess.run(argv, input=payload, capture_output=True, check=True, cwd=cwd, env=bare_env())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    thread_ms: list[float] = []
    process_ms: list[float] = []
    profile = cProfile.Profile()
    with runner(POOL_SIZE, Path(os.devnull)) as warm:

        def warm_call() -> None:
            before, own = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
            if args.profile:
                profile.enable()
            result = warm.call("add_numbers", ADD_PARAMS)
            if args.profile:
                profile.disable()
            after = resource.getrusage(resource.RUSAGE_SELF)
            thread_ms.append((time.thread_time() - own) * 1000)
            used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            process_ms.append(used * 1000)
            if not result.success:
                raise SystemExit(f"call failed: {result.error}")

        samples = timed_together(
            [
                lambda: spawn(["true"]),
                lambda: spawn([*BWRAP_ARGV, "true"]),
                lambda: spawn([PYTHON, "-c", "pass"]),
                lambda: spawn([PYTHON, "main.py"], ADD_PAYLOAD, TOOL),
                warm_call,
            ],
            args.n,
            lambda: wait_full(warm),
        )
    names = ["true", "bwrap + true", "python3 -c pass", "python3 main.py", "warm Runner.call"]
    print(f"n={args.n} per row, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print_table(list(zip(names, samples, strict=True)), "true")
    print(
        f"warm call, the runner's own CPU: calling thread {statistics.median(thread_ms):.2f} ms, "
        f"whole process {statistics.median(process_ms):.2f} ms (medians)"
    )
    if args.profile:
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(r"(runner|sandboxes)/", 20)


if __name__ == "__main__":
    main()
