"""Attacks on a workspace's apply that the root and the rootless runner both face."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conftest import ToolBench

SLOW_WRITER = """
import os, sys, time
sys.stdin.read()
open(os.path.join(os.environ["WORKSPACE"], "out", "report.txt"), "w").write("data")
time.sleep({sleep_s})
print("{{}}")
"""


def swap_a_folder_for_a_symlink_during_the_call(
    bench: ToolBench, workspace: Path, victim: Path, sleep_s: float
) -> None:
    """A tool writes ``out/report.txt``; halfway through its call ``out`` is swapped for a
    symlink to ``victim``. The apply must write into neither, and put ``out`` back."""
    bench.tool("slowwriter", SLOW_WRITER.format(sleep_s=sleep_s), workspace="write")
    runner = bench.runner()

    async def call_and_swap() -> None:
        call = asyncio.ensure_future(runner.acall("slowwriter", {}))
        await asyncio.sleep(sleep_s / 2)
        (workspace / "out").rmdir()
        (workspace / "out").symlink_to(victim)
        assert (await call).success

    asyncio.run(call_and_swap())
    assert list(victim.iterdir()) == []
    assert not (workspace / "out").is_symlink()
    assert (workspace / "out" / "report.txt").read_text() == "data"
