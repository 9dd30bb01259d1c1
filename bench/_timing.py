"""Shared by the benchmarks: the shipped tools in a scratch folder, repeat a call, then
print medians against a baseline row."""

from __future__ import annotations

import atexit
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def starter_folder() -> Path:
    """The shipped policy and tools, as `runner init` writes them, in a folder removed at exit
    (never the installed copies themselves)."""
    from runner.config.starter import write_starter

    folder = Path(tempfile.mkdtemp(prefix="runner-bench-"))
    write_starter(folder)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


PYTHON = "/usr/bin/python3"  # the interpreter the sandboxes run
ADD_PARAMS = {"a": 1, "b": 2}
ADD_PAYLOAD = json.dumps(
    {"params": ADD_PARAMS, "context": {"requestId": "bench", "toolName": "add_numbers", "attempt": 1}}
).encode()
DOCKER_ADD_CODE = (
    "import json, sys\np = json.load(sys.stdin)['params']\njson.dump(p['a'] + p['b'], sys.stdout)\n"
)


def docker_add_folder(root: Path, tools_policy: str = "{}") -> tuple[Path, Path]:
    """A docker tool ``dadd`` (adds ``a`` and ``b``) in ``root/tools`` and a policy letting
    anyone call it, with ``tools_policy`` as its ``tools:``: the tools folder and the policy."""
    tool = root / "tools" / "dadd"
    tool.mkdir(parents=True)
    (tool / "main.py").write_text(DOCKER_ADD_CODE)
    (tool / "tool.yaml").write_text(
        "name: dadd\ndescription: add in docker\ncommand: [python3, main.py]\n"
        "sandbox: docker\nimage: runner/base:latest\nparameters: {type: object}\n"
    )
    policy = root / "policies.yaml"
    policy.write_text(
        "version: 1\ndefault_role: u\nwhitelist: ['*']\nroles: {u: {allow: ['*']}}\n"
        f"tools: {tools_policy}\n"
    )
    return root / "tools", policy


def docker_run_argv(tool: Path) -> list[str]:
    """``docker run --rm -i`` of ``tool`` with the flags the runner's containers get: the
    baseline of the docker benchmarks."""
    return [
        "docker", "run", "--rm", "-i", "--network", "none", "--read-only", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--user", "65534:65534", "--init",
        "--tmpfs", "/tmp:size=64m", "--memory", "256m", "--memory-swap", "256m", "--pids-limit", "64",
        "-v", f"{tool}:/tool:ro", "-w", "/tool", "runner/base:latest", "python3", "main.py",
    ]  # fmt: skip


def bare_env() -> dict[str, str]:
    """The environment of a bare ``python3 main.py`` baseline: what a sandbox gives, with the
    tool-side helper (``runner_tool``, which every sandbox mounts) on the path in place."""
    from sandboxes.view import LIBRARY_SOURCE

    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(LIBRARY_SOURCE)}


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Milliseconds of ``n`` runs of ``fn``, after one warm-up run."""
    (samples,) = timed_together([fn], n)
    return samples


def timed_together(
    fns: list[Callable[[], object]], n: int, before: Callable[[], object] | None = None
) -> list[list[float]]:
    """Milliseconds of ``n`` runs of each of ``fns``, taken in turns (one of each per round,
    ``before()`` untimed ahead of each run) after one warm-up run of each: a machine
    that speeds up or slows down during the run (a shared VM does) weighs on every row
    alike, so their ratios hold."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(n):
        for fn, into in zip(fns, samples, strict=True):
            if before is not None:
                before()
            started = time.perf_counter()
            fn()
            into.append((time.perf_counter() - started) * 1000)
    return samples


def print_table(rows: list[tuple[str, list[float]]], baseline: str) -> None:
    """Median and p90 of each row, as a ratio of and a difference from the first row."""
    base = statistics.median(rows[0][1])
    print(f"{'what':<26}{'median ms':>10}{'p90 ms':>9}{'x ' + baseline:>16}{'+ms':>8}")
    for name, samples in rows:
        median = statistics.median(samples)
        p90 = sorted(samples)[max(0, int(len(samples) * 0.9) - 1)]
        print(f"{name:<26}{median:>10.1f}{p90:>9.1f}{median / base:>16.2f}{median - base:>8.1f}")
