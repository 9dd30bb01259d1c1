"""Where a cold ``Runner.call`` spends its time, phase by phase (issue 13's profile).

    python3 bench/cold_phases.py [--n 30]

Each phase is timed by wrapping the subprocess backend's own functions in this process:
the runner's work before the spawn (policy, validation, ``prepare``: uid lease, cgroup),
the spawn itself (``Popen`` of the launcher and its token line), the sandboxed process
chain (launcher, cgroup join, setpriv, bubblewrap, the tool, up to its exit and the end
of its pipes), and the teardown and answer after that. Medians over ``--n`` calls of the
shipped ``add_numbers``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import starter_folder  # noqa: E402

from runner import Runner  # noqa: E402
from sandboxes.subprocess import _prepared as sandbox  # noqa: E402

marks: dict[str, float] = {}


def _instrument() -> None:
    start = sandbox.PreparedSubprocess._start
    drive = sandbox.drive

    def timed_start(self: Any, *args: Any, **kwargs: Any) -> None:
        marks["spawn_start"] = time.perf_counter()
        try:
            start(self, *args, **kwargs)
        finally:
            marks["spawned"] = time.perf_counter()

    async def timed_drive(*args: Any, **kwargs: Any) -> Any:
        try:
            return await drive(*args, **kwargs)
        finally:
            marks["drained"] = time.perf_counter()

    sandbox.PreparedSubprocess._start = timed_start  # type: ignore[method-assign]
    sandbox.drive = timed_drive


PHASES: tuple[tuple[str, Callable[[float, float], float]], ...] = (
    ("before the spawn", lambda start, _: marks["spawn_start"] - start),
    ("spawn (Popen, token)", lambda *_: marks["spawned"] - marks["spawn_start"]),
    ("process chain, drained", lambda *_: marks["drained"] - marks["spawned"]),
    ("teardown and answer", lambda _, end: end - marks["drained"]),
    ("total", lambda start, end: end - start),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=30)
    args = parser.parse_args()
    starter = starter_folder()
    runner = Runner.load(tools=starter / "tools", policies=starter / "policies.yaml", audit_log=os.devnull)
    _instrument()
    samples: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    for i in range(args.n + 1):
        marks.clear()
        start = time.perf_counter()
        result = runner.call("add_numbers", {"a": 1, "b": 2})
        end = time.perf_counter()
        assert result.success, result.error
        if i == 0:
            continue  # warm-up: first use sets the backend up
        for name, phase in PHASES:
            samples[name].append(phase(start, end) * 1000)
    print(f"{'phase':<24}{'median ms':>10}")
    for name, values in samples.items():
        print(f"{name:<24}{statistics.median(values):>10.2f}")


if __name__ == "__main__":
    main()
