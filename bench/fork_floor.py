"""The floor of a fork mode: calls forked from a pre-imported template, next to bare spawns.

    python3 bench/fork_floor.py [--n 60] [--calls 400] [--concurrency 16]

Measures the mechanics a fork mode would use, without the runner (its policy, validation
and audit add what ``bench/warm_floor.py`` shows): a template of ``add_numbers`` runs in
bubblewrap as an unprivileged uid (``bench/_fork_template.py`` says what it does), and
each call forks from it into a fresh call cgroup (memory and pids limits, joined through
descriptors this process opened), fresh user, mount, pid, IPC, network and UTS
namespaces, a fresh ``/tmp`` and the runner's seccomp filter, before its input exists.
Rows, sampled in turns: a bare ``python3 main.py`` and a forked call, each answer
checked. Then throughput: ``--calls`` of each at ``--concurrency`` callers (threads).
Needs root on cgroup v1 (as the runner's hardened sandboxes do there).
"""

from __future__ import annotations

import argparse
import array
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import ADD_PAYLOAD, PYTHON, bare_env, print_table, timed_together  # noqa: E402

from sandboxes.subprocess._cgroup import CgroupFactory  # noqa: E402
from sandboxes.subprocess._seccomp import filter_fd  # noqa: E402
from sandboxes.view import LIBRARY_SOURCE  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent / "_fork_template.py"
TOOL_SOURCE = REPO / "runner" / "config" / "starter" / "tools" / "add_numbers"
SANDBOX_UID = 65534
MEMORY_MB, MAX_PIDS = 128, 64


def tool_copy() -> Path:
    """``add_numbers`` and the tool helper in a folder the sandbox's uid may read."""
    folder = Path(tempfile.mkdtemp(prefix="runner-fork-"))
    folder.chmod(0o755)
    tool = folder / "add_numbers"
    shutil.copytree(TOOL_SOURCE if TOOL_SOURCE.is_dir() else REPO / "tools" / "add_numbers", tool)
    shutil.copy(LIBRARY_SOURCE / "runner_tool.py", tool / "runner_tool.py")
    shutil.copy(TEMPLATE, folder / TEMPLATE.name)
    for path in (tool, *tool.iterdir(), folder / TEMPLATE.name):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return tool


class Template:
    """The tool's template in its sandbox, and the calls forked from it."""

    def __init__(self, tool: Path) -> None:
        self._cgroups = CgroupFactory()
        self._lock = threading.Lock()
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        seccomp = filter_fd(memory_counted=True)  # root, with a cgroup per call
        argv = [
            "setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
            "bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--ro-bind", str(tool.parent), str(tool.parent), "--clearenv",
            "--", PYTHON, "-s", str(tool.parent / TEMPLATE.name),
            str(tool), str(theirs.fileno()), str(seccomp),
        ]  # fmt: skip
        self.process = subprocess.Popen(argv, pass_fds=(theirs.fileno(), seccomp), stdin=subprocess.DEVNULL)
        theirs.close()
        os.close(seccomp)

    def call(self, payload: bytes) -> tuple[bytes, int]:
        """Stdout and the wait status of one call forked from the template."""
        group = self._cgroups.create(MEMORY_MB, MAX_PIDS)
        mine, theirs = socket.socketpair()
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        reaper = None
        try:
            with self._lock:
                _send_fds(self._control, b"f", [theirs.fileno()])
            theirs.close()
            _, ancillary, _, _ = mine.recvmsg(1, socket.CMSG_SPACE(12))
            ((_, _, creds),) = ancillary
            # Pinned while it waits for our answer: its exit ends the call (the cgroup is
            # empty then and goes at once; read from the cgroup, it would not be yet).
            reaper = os.pidfd_open(struct.unpack("3i", creds)[0])
            tasks = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in group.join_files]
            try:
                _send_fds(mine, b"j", tasks)
            finally:
                for fd in tasks:
                    os.close(fd)
            if mine.recv(1) != b"s":
                raise RuntimeError("a forked call was not sealed")
            answer = _feed(mine, payload)
            (status,) = struct.unpack("i", mine.recv(4))
            select.select([reaper], [], [], 1.0)
            return answer, status
        finally:
            if reaper is not None:
                os.close(reaper)
            mine.close()
            group.remove()  # kills what is left first

    def close(self) -> None:
        self._control.close()
        self.process.wait(timeout=10)


def _send_fds(sock: socket.socket, tag: bytes, fds: list[int]) -> None:
    sock.sendmsg([tag], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def _feed(mine: socket.socket, payload: bytes) -> bytes:
    """Hand the sealed call its stdin, stdout and stderr, write the payload: its stdout."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    theirs = [stdin_r, stdout_w, stderr_w]
    _send_fds(mine, b"i", theirs)
    for fd in theirs:
        os.close(fd)
    os.write(stdin_w, payload)
    os.close(stdin_w)
    with os.fdopen(stdout_r, "rb") as out, os.fdopen(stderr_r, "rb") as err:
        answer = out.read()
        err.read()
    return answer


def bare(tool: Path) -> bytes:
    return subprocess.run(
        [PYTHON, "main.py"], input=ADD_PAYLOAD, capture_output=True, check=True, cwd=tool, env=bare_env()
    ).stdout


def rate(fn: object, calls: int, concurrency: int) -> float:
    assert callable(fn)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as workers:
        list(workers.map(lambda _: fn(), range(calls)))
    return calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    tool = tool_copy()
    template = Template(tool)
    try:

        def forked() -> None:
            answer, status = template.call(ADD_PAYLOAD)
            if answer != b"3" or status != 0:
                raise RuntimeError(f"a forked call answered {answer!r}, status {status}")

        def spawned() -> None:
            if bare(tool) != b"3":
                raise RuntimeError("a bare spawn answered wrong")

        rows = timed_together([spawned, forked], args.n)
        print_table([("bare python3 main.py", rows[0]), ("forked from the template", rows[1])], "bare")
        bare_rate = rate(spawned, args.calls, args.concurrency)
        fork_rate = rate(forked, args.calls, args.concurrency)
        print(
            f"{args.calls} calls at {args.concurrency} callers: bare {bare_rate:.0f}/s, "
            f"forked {fork_rate:.0f}/s ({fork_rate / bare_rate:.2f}x)"
        )
    finally:
        template.close()
        shutil.rmtree(tool.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
