"""Fork mode through the runner: a forked ``Runner.call`` next to a bare spawn and a warm
call measured in the same run, then the rate of each at many callers.

    python3 bench/fork_mode.py [--n 100] [--calls 400] [--concurrency 16]

Latency rows, sampled in turns: a bare ``python3 main.py`` spawn of the shipped
``add_numbers`` (the baseline), a warm ``Runner.call`` (``tools.add_numbers.pool: 2``,
each call made once the pool is full again, as ``bench/pool.py``) and a forked one
(``tools.add_numbers: {pool: 1, pool_mode: fork}``); for the last two, the CPU time of
the calling thread too (the runner's own Python on the call's path). Then throughput: ``--calls`` of each
at ``--concurrency`` callers (threads) on one runner: bare spawns, cold calls (no pool)
and forked calls. Each answer is checked;
the hits of the forked runner's pool are counted to show every call was forked. Needs
what fork mode needs (root, cgroups, Linux 6.15+, x86-64).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import timed_together
from pool import POOL_SIZE, STARTER, bare, call, row, wait_full

from runner import Runner

TOOL = "add_numbers"


def runner_with(pool: dict[str, Any]) -> Runner:
    """A runner whose ``add_numbers`` has the pool ``pool`` (``tools.add_numbers``)."""
    policy = yaml.safe_load((STARTER / "policies.yaml").read_text())
    policy.setdefault("tools", {})[TOOL] = pool
    path = STARTER / f"policies-{pool.get('pool_mode', 'warm')}-{pool['pool']}.yaml"
    path.write_text(yaml.safe_dump(policy))
    return Runner.load(tools=STARTER / "tools", policies=path, audit_log=os.devnull)


def wait_template(r: Runner) -> None:
    deadline = time.monotonic() + 30
    while r.warm_sandboxes().get(TOOL) != 1:
        if time.monotonic() > deadline:
            raise SystemExit("the template was not ready within 30 s (does this machine have fork mode?)")
        time.sleep(0.01)


def rate(work: Any, calls: int, concurrency: int) -> float:
    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as callers:
        list(callers.map(lambda _: work(), range(calls)))
    return calls / (time.monotonic() - began)


def on_cpu(work: Any, into: list[float]) -> Any:
    """``work``, recording the calling thread's CPU milliseconds of each run into ``into``:
    the runner's own Python on the call's path (the sandbox's processes are not counted)."""

    def timed() -> None:
        began = time.thread_time()
        work()
        into.append((time.thread_time() - began) * 1000)

    return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with (
        runner_with({"pool": 0}) as cold,
        runner_with({"pool": POOL_SIZE}) as warm,
        runner_with({"pool": 1, "pool_mode": "fork"}) as forked,
    ):
        wait_template(forked)
        warm_cpu: list[float] = []
        forked_cpu: list[float] = []
        bare_ms, warm_ms, forked_ms = timed_together(
            [bare, on_cpu(lambda: call(warm), warm_cpu), on_cpu(lambda: call(forked), forked_cpu)],
            args.n,
            lambda: wait_full(warm),
        )
        rates = {
            "bare python3 main.py": rate(bare, args.calls, args.concurrency),
            "Runner.call cold": rate(lambda: call(cold), args.calls, args.concurrency),
            "Runner.call forked": rate(lambda: call(forked), args.calls, args.concurrency),
        }
        hits, misses = forked._pools.takes()[TOOL]
    base = statistics.median(bare_ms)
    load = os.getloadavg()[0]
    print(f"n={args.n} per row, {os.cpu_count()} cores, load average {load:.1f} at the end")
    print(f"{'what':<24}{'p50 ms':>9}{'p99 ms':>9}{'p50 x bare':>12}")
    row("bare python3 main.py", bare_ms, base)
    row("Runner.call warm", warm_ms, base)
    row("Runner.call forked", forked_ms, base)
    for name, cpu in (("warm", warm_cpu), ("forked", forked_cpu)):
        print(f"  the calling thread's CPU per {name} call: p50 {statistics.median(cpu):.1f} ms")
    print(f"{args.calls} calls at {args.concurrency} callers:")
    bare_rate = rates["bare python3 main.py"]
    for name, per_s in rates.items():
        print(f"{name:<24}{per_s:>9.0f}/s{per_s / bare_rate:>11.2f}x")
    print(f"forked runner's pool: {hits} hits, {misses} misses")


if __name__ == "__main__":
    main()
