"""Sandbox uid leases (``sandboxes._identity``): a released lease leaves no file behind, so
the lease folder holds about as many files as uids are in use, and the file's removal never
lets two takers hold one uid (a taker re-checks, holding the lock, that the path still
names the file it locked)."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import ToolBench, wait_for

from sandboxes import _identity
from sandboxes._identity import LEASE_DIR, UID_BASE, UID_COUNT, IdentityPool, NoFreeIdentity

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="uids are leased only as root")

BASE = 1_950_000_000


def _files(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


def _leased_or_done(folder: Path, call: threading.Thread) -> bool:
    return len(_files(folder)) > 0 or not call.is_alive()


def test_a_released_lease_leaves_no_file_so_the_folder_holds_only_the_uids_in_use(tmp_path: Path) -> None:
    folder = tmp_path / "uids"
    pool = IdentityPool(folder, base=BASE, count=64)
    held = [pool.lease() for _ in range(5)]
    assert _files(folder) == sorted(str(lease.uid) for lease in held)
    for _ in range(300):  # a busy runner: each lease taken and given back
        pool.lease().release()
        assert len(_files(folder)) == 5
    for lease in held:
        lease.release()
        lease.release()  # twice is harmless
    assert _files(folder) == []


def test_a_runner_killed_holding_leases_leaves_files_the_next_takers_reuse(tmp_path: Path) -> None:
    # The kernel drops a dead holder's locks but not its files: each is then a free uid,
    # taken and, once released, removed like any other.
    folder = tmp_path / "uids"
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from sandboxes._identity import IdentityPool
        pool = IdentityPool(Path({str(folder)!r}), base={BASE}, count=2)
        leases = [pool.lease(), pool.lease()]
        os._exit(0)  # no release: as a runner killed mid-call
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert len(_files(folder)) == 2
    pool = IdentityPool(folder, base=BASE, count=2)
    leases = [pool.lease(), pool.lease()]
    assert sorted(lease.uid for lease in leases) == [BASE, BASE + 1]
    for lease in leases:
        lease.release()
    assert _files(folder) == []


# Each taker marks the uid it holds with a folder of its own; a second holder of the same
# uid finds the mark there (mkdir is atomic) and says so.
TAKER = """
import os, sys, time
from pathlib import Path
from sandboxes._identity import IdentityPool, NoFreeIdentity
folder, marks, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
pool = IdentityPool(folder, base={base}, count=2)
taken = 0
while taken < rounds:
    try:
        lease = pool.lease()
    except NoFreeIdentity:
        continue
    try:
        os.mkdir(marks / str(lease.uid))
    except FileExistsError:
        print(f"uid {{lease.uid}} held twice", flush=True)
        sys.exit(1)
    time.sleep(0.0005)
    os.rmdir(marks / str(lease.uid))
    lease.release()
    taken += 1
print(f"took {{taken}}", flush=True)
"""


def test_takers_racing_for_two_uids_never_hold_the_same_one(tmp_path: Path) -> None:
    folder, marks = tmp_path / "uids", tmp_path / "marks"
    marks.mkdir()
    rounds = 400
    takers = [
        subprocess.Popen(
            [sys.executable, "-c", TAKER.format(base=BASE), str(folder), str(marks), str(rounds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [taker.communicate(timeout=120)[0] for taker in takers]
    assert [taker.returncode for taker in takers] == [0] * 4, outputs
    assert outputs == [f"took {rounds}\n"] * 4
    assert _files(folder) == []


def test_threads_of_one_runner_racing_never_hold_the_same_uid(tmp_path: Path) -> None:
    # Takers in one process go through its pool's lock, but releases do not: a release's
    # removal races the next lease.
    pool = IdentityPool(tmp_path / "uids", base=BASE, count=2)
    holders: dict[int, int] = {}
    guard = threading.Lock()
    doubles: list[int] = []

    def take(rounds: int) -> None:
        done = 0
        while done < rounds:
            try:
                lease = pool.lease()
            except NoFreeIdentity:
                continue
            with guard:
                if holders.get(lease.uid):
                    doubles.append(lease.uid)
                holders[lease.uid] = holders.get(lease.uid, 0) + 1
            time.sleep(0)
            with guard:
                holders[lease.uid] -= 1
            lease.release()
            done += 1

    threads = [threading.Thread(target=take, args=(500,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert doubles == []
    assert _files(tmp_path / "uids") == []


@pytest.fixture
def private_leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The runner's sandboxes lease from a folder of this test's own (the host's is shared
    with every runner on the machine)."""
    folder = tmp_path / "uids"
    pool = IdentityPool(folder, base=BASE, count=64)
    monkeypatch.setattr(_identity, "shared_identities", lambda: pool)
    yield folder


def test_after_many_calls_the_lease_folder_holds_only_the_uids_in_use(
    bench: ToolBench, private_leases: Path
) -> None:
    bench.tool("nap", "import json, sys, time\njson.load(sys.stdin)\ntime.sleep(0.3)\nprint('{}')")
    with bench.runner(warm_pools=False) as runner:
        seen_during: list[int] = []
        for _ in range(20):
            call = threading.Thread(target=lambda: runner.handle({"toolName": "nap"}))
            call.start()
            wait_for(functools.partial(_leased_or_done, private_leases, call))
            seen_during.append(len(_files(private_leases)))
            call.join()
            # The sandbox is torn down just after its answer, off the call's path.
            wait_for(lambda: _files(private_leases) == [], 5.0)
    assert seen_during == [1] * 20  # each call's sandbox did lease from this folder


@pytest.mark.skipif(os.geteuid() != 0, reason="uids are leased by a root runner only")
def test_the_watchdog_of_a_killed_runner_removes_its_lease_files(bench: ToolBench) -> None:
    # Its locks die with it, its files did not: a taker, starting round-robin from a
    # random uid of 65,536, seldom meets one again, and the folder grew by each kill.
    bench.tool("sleeper", "import sys, time\nsys.stdin.read()\ntime.sleep(60)\n")
    proc = bench.spawn_runner("sleeper", "req_lease_kill")
    try:
        uid = None
        for _ in range(300):
            uids = set()
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    uids.add(child.uids().real)
            leased = sorted(u for u in uids if UID_BASE <= u < UID_BASE + UID_COUNT)
            if leased:
                uid = leased[0]
                break
            time.sleep(0.1)
        assert uid is not None, "the sleeper never ran under a leased uid"
        assert (LEASE_DIR / str(uid)).exists()
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not (LEASE_DIR / str(uid)).exists(), 30.0)


def test_the_sweep_leaves_held_leases_and_what_is_not_a_lease_file_and_goes_on(tmp_path: Path) -> None:
    folder = tmp_path / "uids"
    pool = IdentityPool(folder, base=BASE, count=4)
    held = pool.lease()
    (folder / str(BASE + 100)).mkdir()  # a folder with a lease's name: stopped the sweep
    for uid in (BASE + 101, BASE + 102):
        (folder / str(uid)).touch()  # left by a runner that died
    assert _identity.sweep_unheld(folder) == 2
    assert sorted(_files(folder)) == sorted([str(held.uid), str(BASE + 100)])
    held.release()
