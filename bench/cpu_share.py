"""Where a call's CPU goes, process by process: the profile behind the ratios of ``load.py``.

    python3 bench/cpu_share.py [--calls 300] [--concurrency 16] [--pool 8]

Needs ``perf`` and the right to sample every CPU (root, or ``kernel.perf_event_paranoid``
at -1). Runs three batches of ``add_numbers`` calls, each under ``perf record -a``: bare
``python3 main.py`` spawns, cold ``Runner`` calls and pooled ones (``pool: N``). Each
sample is charged to the process that was on the CPU (by its name at that moment, so a
launcher that execs ``setpriv`` then ``bwrap`` is split into its three steps) and the
totals are printed as milliseconds of CPU per call: this process (the runner; for bare
spawns, the spawner), the tool's interpreter, bubblewrap, the shells, ``setpriv``, the
kernel's own threads (e.g. the work of freeing a network namespace, done in a worker)
and the rest. Run it on an otherwise idle machine: everything the machine does in a
batch is charged to its calls. The batches are ``load.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from load import STARTER, bare_rate, load, pooled_runner

from runner import Runner

KERNEL_THREADS = ("kworker", "ksoftirqd", "rcu_", "migration", "kthreadd", "kdamond", "kcompactd")
GROUPS = ("this process", "tool interpreter", "bwrap", "sh", "setpriv", "kernel threads", "other")


def runner_batch(runner: Runner, calls: int, concurrency: int) -> None:
    """``calls`` calls of ``add_numbers`` through ``runner`` (``load.load``), each answer checked."""
    _, correct = asyncio.run(load(runner, range(calls), concurrency))
    if correct != calls:
        raise SystemExit(f"{calls - correct} of {calls} calls went wrong")


def profiled(name: str, work: Callable[[], object], folder: Path) -> Path:
    """Runs ``work`` while ``perf record -a`` samples every CPU; the recording's path."""
    data = folder / f"{name}.data"
    perf = subprocess.Popen(
        ["perf", "record", "-a", "-F", "1999", "-o", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.5)  # perf opens its events on every CPU before it samples
    try:
        work()
    finally:
        perf.send_signal(2)
        _, err = perf.communicate(timeout=60)
    if perf.returncode not in (0, -2) or not data.exists():
        raise SystemExit(f"perf record failed: {err.decode(errors='replace').strip()}")
    return data


def group_of(pid: int, comm: str) -> str:
    if pid == os.getpid():
        return "this process"  # the runner (or, for bare spawns, the spawner)
    if comm.startswith("python3") or comm == "main.py":
        return "tool interpreter"
    if comm in ("bwrap", "sh", "setpriv"):
        return comm
    if comm.startswith(KERNEL_THREADS):
        return "kernel threads"
    return "other"


def cpu_ms_by_group(data: Path) -> dict[str, float]:
    """CPU milliseconds sampled in ``data``, summed by group (idle left out)."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "-q", "--sort", "pid,comm", "-F", "period,pid,comm"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    totals: dict[str, float] = collections.defaultdict(float)
    for line in report.splitlines():
        fields = line.split()
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        pid_text, comm = fields[1].split(":", 1)[0], " ".join(fields[2:])
        if pid_text in ("0", "-1"):
            continue  # idle, and samples perf could not place
        totals[group_of(int(pid_text), comm)] += int(fields[0]) / 1e6  # cpu-clock periods are ns
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pool", type=int, default=8)
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("cpu_share.py needs perf (Debian: apt-get install linux-perf)")
    folder = Path(tempfile.mkdtemp(prefix="runner-cpu-share-"))
    try:
        cold = Runner.load(tools=STARTER / "tools", policies=STARTER / "policies.yaml", audit_log=os.devnull)
        pooled = pooled_runner(args.pool, Path(os.devnull))
        runner_batch(pooled, args.pool, 1)  # the pool's first filling is not charged to the batch
        time.sleep(2)
        batches = {
            "bare spawns": lambda: bare_rate(args.calls, args.concurrency),
            "cold calls": lambda: runner_batch(cold, args.calls, args.concurrency),
            f"pooled calls (pool: {args.pool})": lambda: runner_batch(pooled, args.calls, args.concurrency),
        }
        rows = {}
        for name, work in batches.items():
            started = time.perf_counter()
            data = profiled(name.split()[0], work, folder)
            wall = time.perf_counter() - started
            rows[name] = ({k: v / args.calls for k, v in cpu_ms_by_group(data).items()}, args.calls / wall)
        for runner in (cold, pooled):
            runner.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"CPU per call in ms, {args.calls} calls at {args.concurrency} callers")
    print(f"{'':30}" + "".join(f"{group:>17}" for group in (*GROUPS, "all", "calls/s")))
    bare_total = sum(rows["bare spawns"][0].values())
    for name, (groups, rate) in rows.items():
        total = sum(groups.values())
        cells = "".join(f"{groups.get(group, 0.0):17.2f}" for group in GROUPS)
        print(f"{name:30}{cells}{total:17.2f}{rate:17.1f}   CPU bare/this {bare_total / total:.2f}")


if __name__ == "__main__":
    main()
