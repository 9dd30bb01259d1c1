"""The runner's side of its watchdog (``sandboxes._watchdog``): a watchdog that dies is
started again and told again; init notices never wait and are never lost; a forked child
starts its own. Each case runs in a fresh interpreter, which has a watchdog of its own."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sandboxes._watchdog import _lines

REPO = Path(__file__).resolve().parents[2]
PRELUDE = """
import json, os, signal, sys, threading, time
sys.path.insert(0, "tests")
from conftest import watchdogs_of
from sandboxes import _watchdog as w
from sandboxes._watchdog import parent_and_start

def watchdog_pids():
    return watchdogs_of(os.getpid())

def zombies():
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                stat = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] == "Z" and int(stat[1]) == os.getpid():
                found.append(int(p))
    return found

def wait_until(check, within=20.0):
    deadline = time.monotonic() + within
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()
"""


def run(code: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_a_killed_watchdog_is_started_again_told_again_and_reaped() -> None:
    found = run("""
        w.watch("scratch", "/nonexistent-scratch")
        first = watchdog_pids()
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: watchdog_pids() not in ([], first))
        second = watchdog_pids()
        wait_until(lambda: not zombies(), 5)
        print(json.dumps({"first": first, "second": second, "zombies": zombies(),
                          "told": sorted(w._link.told)}))
    """)
    assert len(found["first"]) == 1 and len(found["second"]) == 1, found
    assert found["second"] != found["first"], found
    assert found["zombies"] == [], found
    assert found["told"] == ["scratch\t/nonexistent-scratch\n"], found


def test_an_init_notice_never_waits_and_is_written_by_the_thread_holding_the_link() -> None:
    found = run("""
        w.ensure()
        held, go_on = threading.Event(), threading.Event()
        def holder():
            with w._holding():
                held.set()
                go_on.wait()
        thread = threading.Thread(target=holder)
        thread.start()
        held.wait()
        started = time.monotonic()
        w.watch_sandbox_init(os.getpid(), parent_and_start(os.getpid())[1])
        waited = time.monotonic() - started
        queued = len(w._link.queue)
        go_on.set()
        thread.join()
        print(json.dumps({"waited": waited, "queued_while_held": queued,
                          "queued_after": len(w._link.queue), "inits": len(w._link.inits)}))
    """)
    assert found["waited"] < 1.0 and found["queued_while_held"] == 1, found
    assert found["queued_after"] == 0 and found["inits"] == 1, found


def test_a_stopped_watchdog_never_blocks_an_init_notice() -> None:
    found = run("""
        w.ensure()
        (dog,) = watchdog_pids()
        os.kill(dog, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for n in range(5000):  # far more than a pipe holds
                w.watch_sandbox_init(1000000 + n, n)
            waited = time.monotonic() - started
            left = len(w._link.queue)
        finally:
            os.kill(dog, signal.SIGCONT)  # the monitor writes the rest as room is made
        wait_until(lambda: not w._link.queue)
        print(json.dumps({"waited": waited, "left_while_stopped": left, "left": len(w._link.queue)}))
    """)
    assert found["waited"] < 10.0 and found["left_while_stopped"] > 0, found
    assert found["left"] == 0, found


def test_a_forked_child_starts_a_watchdog_of_its_own_told_its_kinds_not_its_parents_inits() -> None:
    found = run("""
        w.watch("scratch", "/nonexistent-scratch")
        w.watch_sandbox_init(os.getpid(), parent_and_start(os.getpid())[1])
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            before = {"owner": w._link.owner, "inits": len(w._link.inits), "told": sorted(w._link.told)}
            w.ensure()
            mine = watchdog_pids()
            os.write(write, json.dumps({**before, "mine": len(mine)}).encode())
            os._exit(0)
        os.waitpid(child, 0)
        print(os.read(read, 65536).decode())
    """)
    assert found == {"owner": 0, "inits": 0, "told": ["scratch\t/nonexistent-scratch\n"], "mine": 1}, found


def test_the_docker_sdks_import_path_is_told_in_lines_the_pipe_writes_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entries = [f"/opt/venvs/{n:04d}/" + "x" * 60 + "/site-packages" for n in range(400)]
    monkeypatch.setattr(sys, "path", entries)
    lines = _lines("docker", "")
    assert len(lines) > 1
    assert all(len(line.encode()) < select.PIPE_BUF and line.startswith("docker\t") for line in lines)
    told = [entry for line in lines for entry in line[len("docker\t") : -1].split(os.pathsep)]
    assert told == entries
