"""Attacks on a workspace's apply that the root and the rootless runner both face."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conftest import ToolBench

# Tries to make a set-uid and a set-gid file in the workspace: by chmod and at creation.
SET_ID_MAKER = """
import json, os, shutil, sys
sys.stdin.read()
ws = os.environ["WORKSPACE"]
report = {}
target = os.path.join(ws, "py")
shutil.copyfile("/usr/bin/python3", target)
for mode in (0o4755, 0o2755):
    try:
        os.chmod(target, mode)
        report[oct(mode)] = "set"
    except OSError as exc:
        report[oct(mode)] = exc.errno
try:
    os.close(os.open(os.path.join(ws, "made"), os.O_CREAT | os.O_WRONLY, 0o6755))
    report["create"] = "made"
except OSError as exc:
    report["create"] = exc.errno
print(json.dumps(report))
"""
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
