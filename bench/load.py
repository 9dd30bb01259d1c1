"""Many calls at once through one ``Runner``: correctness, latency and leftovers under load.

    python3 bench/load.py [--calls 1000] [--concurrency 64] [--rounds 4] [--pool 8] [--fork]

Each call adds two numbers chosen for it, so a wrong or swapped answer is caught. Prints
p50/p99 of the calls' own durations and the throughput, next to a bare ``python3 main.py``
spawn of the same tool measured in the same run (the cold-call ratio). With ``--pool N``
(0: skip) a second runner whose policy gives ``add_numbers`` a warm pool of ``N`` takes
the same load, and the warm hits (the audit's ``warm``) are counted; with ``--fork`` a
third runner takes it with ``add_numbers`` in fork mode (each call forked from a
template of the tool, once the template is ready). The throughput is
measured in rounds, each a batch of bare spawns then a batch of cold runner calls then
one of pooled calls, so that a machine that slows down or speeds up during the run (a
shared VM does) weighs on every rate alike; the ratios are those of the totals. Each
batch's CPU per call is the whole machine's busy time over its calls (``/proc/stat``:
meaningful only when nothing else runs), and the runner process's own share. Then the
runners' own memory and descriptors before and after (psutil), then checks that no
sandbox process, cgroup or staged workspace of this process is left (sandbox processes
are found by their command line, so another runner's on the same machine counts too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import bare_env, starter_folder, timed  # noqa: E402

from runner import Runner  # noqa: E402

STARTER = starter_folder()
TOOL = STARTER / "tools" / "add_numbers"
PYTHON = "/usr/bin/python3"
BARE_ENV = bare_env()


def bare() -> None:
    payload = b'{"params": {"a": 1, "b": 2}, "context": {"requestId": "b", "toolName": "add_numbers"}}'
    argv = [PYTHON, "main.py"]
    subprocess.run(argv, input=payload, capture_output=True, cwd=TOOL, check=True, env=BARE_ENV)


def bare_rate(calls: int, concurrency: int) -> float:
    """Bare spawns per second with the same number of callers on the same cores: what the
    machine itself allows, the ceiling of any sandboxed throughput."""
    with ThreadPoolExecutor(concurrency) as pool:
        started = time.perf_counter()
        list(pool.map(lambda _: bare(), range(calls)))
        return calls / (time.perf_counter() - started)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``): what a
    batch of calls cost, sandboxes and tools included, when nothing else runs."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def leftovers() -> list[str]:
    """Anything of this process's calls still there: cgroups, sandbox processes, mounts."""
    found = []
    mine = f"{os.getpid()}-"
    for calls in Path("/sys/fs/cgroup").glob("**/runner-calls"):
        found += [str(p) for p in calls.iterdir() if p.name.startswith(mine)]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if any(mark in cmdline for mark in (b"runner-exec", b"runner-launch", b"runner_fork.py")):
                found.append(f"process {entry.name}")
    mounts = Path("/proc/self/mounts").read_text()
    found += [line.split()[1] for line in mounts.splitlines() if f"/runner-ws/{mine}" in line]
    return found


async def load(runner: Runner, calls: range, concurrency: int) -> tuple[list[float], int]:
    gate = asyncio.Semaphore(concurrency)
    durations: list[float] = []
    correct = 0

    async def one(i: int) -> None:
        nonlocal correct
        async with gate:
            started = time.perf_counter()
            result = await runner.acall("add_numbers", {"a": i, "b": 1000 * i}, timeout=30000, deadline=60000)
            durations.append((time.perf_counter() - started) * 1000)
            if result.success and result.result == 1001 * i:
                correct += 1
            elif not result.success:
                print(f"call {i}: {result.error}", file=sys.stderr)

    await asyncio.gather(*(one(i) for i in calls))
    return durations, correct


def pooled_runner(size: int, audit: Path, mode: str = "warm") -> Runner:
    """A runner whose policy gives ``add_numbers`` a pool of ``size`` (``mode``: warm or fork)."""
    policy = yaml.safe_load((STARTER / "policies.yaml").read_text())
    policy.setdefault("tools", {})["add_numbers"] = {"pool": size, "pool_mode": mode}
    path = STARTER / f"policies-{mode}{size}.yaml"
    path.write_text(yaml.safe_dump(policy))
    runner = Runner.load(tools=STARTER / "tools", policies=path, audit_log=audit)
    deadline = time.monotonic() + 30
    while mode == "fork" and runner.warm_sandboxes().get("add_numbers") != 1:
        if time.monotonic() > deadline:
            raise SystemExit("no fork-mode template within 30 s (does this machine have fork mode?)")
        time.sleep(0.01)
    return runner


def warm_attempts(audit: Path) -> tuple[int, int]:
    """(warm, all) ``call.attempt`` events of ``audit``."""
    events = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
    attempts = [event for event in events if event.get("event") == "call.attempt"]
    return sum(1 for event in attempts if event.get("warm") is True), len(attempts)


class Rows:
    """The durations, right answers and wall time of one runner over the rounds."""

    def __init__(self, name: str, runner: Runner) -> None:
        self.name, self.runner = name, runner
        self.durations: list[float] = []
        self.correct = 0
        self.wall = 0.0
        self.busy = 0.0  # the machine's CPU seconds during the rounds
        self.own = 0.0  # the runner process's

    def round(self, calls: range, concurrency: int) -> None:
        started, busy, own = time.perf_counter(), busy_cpu_s(), own_cpu_s()
        done, right = asyncio.run(load(self.runner, calls, concurrency))
        self.wall += time.perf_counter() - started
        self.busy += busy_cpu_s() - busy
        self.own += own_cpu_s() - own
        self.durations += done
        self.correct += right

    def line(self, calls: int, ceiling: float) -> str:
        ordered = sorted(self.durations)
        p50 = ordered[len(ordered) // 2]
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        rate = calls / self.wall
        return (
            f"{self.name:<7} {self.correct} correct, p50 {p50:.0f} ms, p99 {p99:.0f} ms, "
            f"{rate:.0f} calls/s = {rate / ceiling:.2f}x bare; "
            f"CPU per call {self.busy / calls * 1000:.1f} ms (the runner's {self.own / calls * 1000:.1f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pool", type=int, default=8, help="pool size of the pooled runner (0: none)")
    parser.add_argument("--fork", action="store_true", help="a third runner, with add_numbers in fork mode")
    args = parser.parse_args()
    per_round = args.calls // args.rounds
    load_before = os.getloadavg()[0]
    runner = Runner.load(tools=STARTER / "tools", policies=STARTER / "policies.yaml", audit_log=os.devnull)
    rows = [Rows("cold", runner)]
    audit = STARTER / "pooled-audit.log"
    if args.pool:
        rows.append(Rows(f"pool {args.pool}", pooled_runner(args.pool, audit)))
    fork_audit = STARTER / "forked-audit.log"
    if args.fork:
        rows.append(Rows("forked", pooled_runner(1, fork_audit, "fork")))
    bare_ms = statistics.median(timed(bare, 20))
    cold_ms = statistics.median(timed(lambda: runner.call("add_numbers", {"a": 1, "b": 2}), 20))
    me = psutil.Process()
    rss_before, fds_before = me.memory_info().rss, me.num_fds()
    bare_wall = bare_busy = 0.0
    for start in range(0, per_round * args.rounds, per_round):
        busy = busy_cpu_s()
        bare_wall += per_round / bare_rate(per_round, args.concurrency)
        bare_busy += busy_cpu_s() - busy
        for row in rows:
            row.round(range(start, start + per_round), args.concurrency)
    calls = per_round * args.rounds
    ceiling = calls / bare_wall
    rss_after, fds_after = me.memory_info().rss, me.num_fds()
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores")
    print(f"bare python3 main.py      median {bare_ms:7.1f} ms")
    print(f"Runner.call, one at once  median {cold_ms:7.1f} ms   {cold_ms / bare_ms:5.2f}x bare")
    print(f"{calls} calls at concurrency {args.concurrency} in {args.rounds} rounds:")
    print(f"bare    {ceiling:.0f} spawns/s; CPU per spawn {bare_busy / calls * 1000:.1f} ms")
    for row in rows:
        print(row.line(calls, ceiling))
    for row in rows:
        row.runner.close()
    if args.pool:
        warm, attempts = warm_attempts(audit)
        print(f"pooled runner: {warm} of {attempts} attempts warm")
    if args.fork:
        warm, attempts = warm_attempts(fork_audit)
        print(f"forked runner: {warm} of {attempts} attempts forked")
    print(
        f"runner process: RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB, "
        f"open descriptors {fds_before} -> {fds_after}"
    )
    settle_by = time.monotonic() + 5  # teardown ends in threads: give the last ones time
    while (left := leftovers()) and time.monotonic() < settle_by:
        time.sleep(0.2)
    print(f"leftovers: {left or 'none'}")
    sys.exit(0 if all(row.correct == calls for row in rows) and not left else 1)


if __name__ == "__main__":
    main()
