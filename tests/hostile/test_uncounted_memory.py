"""Memory a tool can hold where no process's resident size shows it: an unmapped memfd,
a System V shared memory segment no process has attached, messages queued on System V
message queues, System V semaphore sets.

A cgroup charges all of these to the call. A runner without root and without a
delegated cgroup only sums the resident memory of the tool's processes (``_tree``), so
there the seccomp filter refuses the calls that make them. Each hoarder tries to hold
three times ``memory_mb`` and then waits long enough for the runner to look: the call
must end ``memory_limit``, or the tool must have been refused before it held anything;
never a success holding past the limit. Run as a user by ``scripts/test-rootless.sh``.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
from conftest import ToolBench, call_cgroups

from sandboxes._staging import INODES_PER_MB

MEMORY_MB = 128
HOARDER = """
import ctypes, json, os, sys, time
sys.stdin.read()
vector, target_mb = sys.argv[1], int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
libc.shmdt.argtypes = (ctypes.c_void_p,)
MB = 1024 * 1024
IPC_CREAT, IPC_NOWAIT = 0o1000, 0o4000
kept = []

def checked(result, failed=-1):
    if result == failed:
        raise OSError(ctypes.get_errno(), vector)
    return result

def memfd():  # 32 MB written to a memfd never mapped (RLIMIT_FSIZE is disk_mb)
    fd = os.memfd_create("hoard")
    kept.append(fd)
    for _ in range(32):
        os.write(fd, b"x" * MB)
    return 32

def shm():  # a 32 MB segment, written through an attachment dropped at once
    ident = checked(libc.shmget(0, 32 * MB, IPC_CREAT | 0o600))
    address = checked(libc.shmat(ident, None, 0), ctypes.c_void_p(-1).value)
    ctypes.memset(address, 1, 32 * MB)
    libc.shmdt(address)
    return 32

MESSAGE = ctypes.create_string_buffer(8 + 8192)
ctypes.c_long.from_buffer(MESSAGE).value = 1

def msg():  # a queue of its own holding two messages of 8 KiB (its default bound)
    ident = checked(libc.msgget(0, IPC_CREAT | 0o600))
    for _ in range(2):
        checked(libc.msgsnd(ident, MESSAGE, 8192, IPC_NOWAIT))
    return 16 / 1024

def sem():  # 32000 semaphores: about 2 MB of kernel memory (64 bytes each)
    checked(libc.semget(0, 32000, IPC_CREAT | 0o600))
    return 2

def available_mb():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024

before = available_mb()
hoard = {"memfd": memfd, "shm": shm, "msg": msg, "sem": sem}[vector]
held, refused = 0.0, None
try:
    while held < target_mb:
        held += hoard()
except OSError as exc:
    refused = exc.errno
time.sleep(2)  # held while the runner looks, several times
print(json.dumps({"held_mb": held, "refused": refused, "available_drop_mb": before - available_mb()}))
"""


def hoard(bench: ToolBench, vector: str) -> dict[str, Any]:
    bench.tool(
        vector,
        HOARDER,
        command=["python3", "main.py", vector, str(3 * MEMORY_MB)],
        limits={"memory_mb": MEMORY_MB, "disk_mb": 64, "timeout_ms": 20000},
    )
    answer: dict[str, Any] = bench.runner().handle({"toolName": vector, "options": {"retries": 0}})
    return answer


def assert_held_no_more_than_the_limit(answer: dict[str, Any]) -> None:
    if not answer["success"]:
        assert answer["error"]["details"]["reason"] == "memory_limit", answer
        return
    result = answer["result"]
    assert result["held_mb"] <= MEMORY_MB, answer
    if not call_cgroups():  # the filter refused the first call: nothing was held
        assert (result["refused"], result["held_mb"]) == (errno.EPERM, 0), answer


@pytest.mark.skipif(os.geteuid() == 0, reason="about a runner that is not root: scripts/test-rootless.sh")
@pytest.mark.parametrize("vector", ["memfd", "shm", "msg", "sem"])
def test_memory_no_process_maps_cannot_be_held_past_the_limit_without_a_cgroup(
    bench: ToolBench, vector: str
) -> None:
    assert_held_no_more_than_the_limit(hoard(bench, vector))


LEGITIMATE_MEMFD = """
import json, os, sys
sys.stdin.read()
fd = os.memfd_create("scratch")
os.write(fd, b"kept in memory")
print(json.dumps({"read": os.pread(fd, 64, 0).decode()}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the root runner's cgroup charges a memfd's pages")
def test_with_a_cgroup_a_tool_may_still_use_memfd_and_is_held_to_the_limit(bench: ToolBench) -> None:
    bench.tool("memfd_user", LEGITIMATE_MEMFD)
    answer = bench.runner().handle({"toolName": "memfd_user", "options": {"retries": 0}})
    assert answer["result"] == {"read": "kept in memory"}, answer
    hoarded = hoard(bench, "memfd")
    assert not hoarded["success"] and hoarded["error"]["details"]["reason"] == "memory_limit", hoarded


# Empty files cost no tmpfs page but an inode each (~800 bytes of kernel memory, more with
# a long name): without a cgroup only the tmpfs's own inode limit stops them.
FILLER = """
import errno, json, os, sys
sys.stdin.read()
folder, made, refused = sys.argv[1], 0, None
mode = os.stat(folder).st_mode & 0o7777
options = [line.split()[5] for line in open("/proc/self/mountinfo") if line.split()[4] == folder]
try:
    while made < 50000:
        os.close(os.open(os.path.join(folder, "%0200d" % made), os.O_CREAT | os.O_WRONLY, 0o600))
        made += 1
except OSError as exc:
    refused = exc.errno
print(json.dumps({"made": made, "refused": refused, "mode": mode, "options": options}))
"""
SCRATCH_DISK_MB = 8


def fill(bench: ToolBench, folder: str, limits: dict[str, int]) -> dict[str, Any]:
    """The answer of FILLER run on ``folder`` with ``disk_mb`` SCRATCH_DISK_MB and ``limits``."""
    bench.tool(
        "filler",
        FILLER,
        command=["python3", "main.py", folder],
        limits={"disk_mb": SCRATCH_DISK_MB, **limits},
    )
    answer: dict[str, Any] = bench.runner().handle({"toolName": "filler", "options": {"retries": 0}})
    return answer


@pytest.mark.skipif(os.geteuid() == 0, reason="about a runner that is not root: scripts/test-rootless.sh")
@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm"])
def test_a_tool_cannot_fill_its_scratch_with_empty_files_without_a_cgroup(
    bench: ToolBench, folder: str
) -> None:
    answer = fill(bench, folder, {"timeout_ms": 30000})
    assert answer["success"], answer
    result = answer["result"]
    assert result["refused"] == errno.ENOSPC, answer
    assert result["mode"] == 0o1777, answer  # as bubblewrap's own tmpfs
    assert {"nosuid", "nodev"} <= set(result["options"][-1].split(",")), answer
    entries = max(1024, SCRATCH_DISK_MB * INODES_PER_MB)
    assert entries // 2 <= result["made"] <= entries, answer


@pytest.mark.skipif(os.geteuid() != 0, reason="the root runner's cgroup charges the inodes")
@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm"])
def test_with_a_cgroup_empty_files_in_the_scratch_count_against_the_memory_limit(
    bench: ToolBench, folder: str
) -> None:
    # As root bubblewrap's tmpfs is bounded in size only; the inodes are the cgroup's.
    answer = fill(bench, folder, {"memory_mb": 32, "timeout_ms": 60000})
    assert not answer["success"] and answer["error"]["details"]["reason"] == "memory_limit", answer


@pytest.mark.skipif(os.geteuid() == 0, reason="about a runner that is not root: scripts/test-rootless.sh")
def test_a_kernel_refusing_the_bounded_tmpfs_fails_the_call_closed(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An option this kernel does not know stands for one that refuses the mount: the call
    # is sandbox_unavailable, never run on bubblewrap's tmpfs bounded in size only.
    from sandboxes.subprocess import _launch

    script = _launch.USER_TMPFS_SCRIPT.replace("nr_inodes=", "nosuch=")
    monkeypatch.setattr(_launch, "USER_TMPFS_SCRIPT", script)
    bench.tool("filler", FILLER, command=["python3", "main.py", "/tmp"], limits={"disk_mb": SCRATCH_DISK_MB})
    answer = bench.runner().handle({"toolName": "filler", "options": {"retries": 0}})
    assert answer["success"] is False, answer
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable", answer["error"]
    assert "nr_inodes" in answer["error"]["message"], answer["error"]
