"""Which process a rootless sandbox's tree tells the watchdog to hold (``sandboxes.subprocess._tree``)."""

from __future__ import annotations

import subprocess

import psutil
import pytest
from conftest import wait_for

from sandboxes.base import Limits
from sandboxes.subprocess._tree import ProcessTree


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    pids: list[int] = []
    monkeypatch.setattr(
        "sandboxes.subprocess._tree.watch_sandbox_init", lambda pid, _started: pids.append(pid)
    )
    return pids


def _with_a_child(argv: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    process = subprocess.Popen(argv)
    wait_for(lambda: bool(psutil.Process(process.pid).children()), 10.0)
    return process, psutil.Process(process.pid).children()[0].pid


def test_no_child_of_the_launcher_is_taken_for_the_init_before_it_is_bubblewrap(told: list[int]) -> None:
    # The launcher's own steps (the rootless mounts) run as its children before it execs
    # bubblewrap: one of them, held as the init, would leave the real init unheld.
    launcher, _ = _with_a_child(["sh", "-c", "sleep 30 & wait"])
    try:
        ProcessTree(launcher.pid, Limits()).look()
        assert told == []
    finally:
        launcher.kill()
        launcher.wait()


def test_bubblewraps_child_is_the_init_the_watchdog_holds(told: list[int]) -> None:
    argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid"]
    launcher, init = _with_a_child([*argv, "--die-with-parent", "sleep", "30"])
    try:
        tree = ProcessTree(launcher.pid, Limits())
        tree.look()
        assert told == [init]
        tree.look()  # told once
        assert told == [init]
    finally:
        launcher.kill()
        launcher.wait()  # its init dies with it (--die-with-parent)
