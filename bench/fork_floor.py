"""The floor of a fork mode: calls forked from a pre-imported template, next to bare spawns.

    python3 bench/fork_floor.py [--n 60] [--calls 400] [--concurrency 16] [--python-loop]

Measures the mechanics a fork mode would use, without the runner (its policy, validation
and audit add what ``bench/warm_floor.py`` shows): a template of ``add_numbers`` runs in
bubblewrap as an unprivileged uid (``bench/_fork_template.py`` says what it does), and
each call forks from it into a fresh call cgroup (memory and pids limits, joined through
descriptors this process opened), fresh user, mount, pid, IPC, network and UTS
namespaces, a fresh ``/tmp`` and the runner's seccomp filter, before its input exists.
Rows, sampled in turns: a bare ``python3 main.py`` and a forked call, each answer
checked. Then throughput: ``--calls`` of each at ``--concurrency`` callers (threads).
The template's fork loop is C (``bench/_fork_loop.c``, built here with ``cc``);
``--python-loop`` measures the earlier loop in Python instead. Before the template gets
the filter, this process checks it from outside: no other process in its sandbox, its
namespaces still bubblewrap's, one descriptor open (the control socket), no shared
mapping. Needs root on cgroup v1 (as the runner's hardened sandboxes do there), except
``--frozen`` (``bench/_frozen.py``), which also runs as an unprivileged user.
"""

from __future__ import annotations

import argparse
import array
import contextlib
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

from _frozen import FrozenTemplate  # noqa: E402
from _timing import ADD_PAYLOAD, PYTHON, bare_env, print_table, timed_together  # noqa: E402

from sandboxes._identity import lease_identity  # noqa: E402
from sandboxes.subprocess._cgroup import CgroupFactory  # noqa: E402
from sandboxes.subprocess._seccomp import compiled_filter, filter_fd  # noqa: E402
from sandboxes.view import LIBRARY_SOURCE  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent / "_fork_template.py"
LOOP_SOURCE = TEMPLATE.parent / "_fork_loop.c"
LOOP = "_fork_loop.so"
NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")
TOOL_SOURCE = REPO / "runner" / "config" / "starter" / "tools" / "add_numbers"
if not TOOL_SOURCE.is_dir():
    TOOL_SOURCE = REPO / "tools" / "add_numbers"
SANDBOX_UID = 65534
MEMORY_MB, MAX_PIDS = 128, 64


def tool_copy(source: Path = TOOL_SOURCE) -> Path:
    """The tool (``add_numbers``), the tool helper, the template and its loop, built, in a
    folder the sandbox's uid may read."""
    folder = Path(tempfile.mkdtemp(prefix="runner-fork-"))
    folder.chmod(0o755)
    tool = folder / source.name
    shutil.copytree(source, tool)
    if not (tool / "runner_tool.py").exists():
        shutil.copy(LIBRARY_SOURCE / "runner_tool.py", tool / "runner_tool.py")
    shutil.copy(TEMPLATE, folder / TEMPLATE.name)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", folder / LOOP, LOOP_SOURCE], check=True)
    for path in (tool, *tool.iterdir(), folder / TEMPLATE.name, folder / LOOP):
        path.chmod(0o755 if path.is_dir() or path.suffix == ".so" else 0o644)
    return tool


def sandbox_argv(
    tool: Path, read_only: bool = True, uid: int = SANDBOX_UID, gid: int = SANDBOX_UID
) -> list[str]:
    """The template's sandbox: bubblewrap as an unprivileged uid (as root, switched to
    ``uid`` first; rootless, as ourselves), fresh namespaces.

    Read-only: a call's own mounts cover /tmp, /dev/shm and /dev/pts, but a file it could
    write in the template's /dev or /tmp (reached by ../ from its cwd) would be there for
    the next call. The Python loop is kept as it was, without."""
    switch = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"] if os.geteuid() == 0 else []
    return [
        *switch,
        "bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
        "--uid", str(uid), "--gid", str(gid), "--die-with-parent", "--new-session",
        "--cap-drop", "ALL", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
        "--tmpfs", "/tmp", "--ro-bind", str(tool.parent), str(tool.parent),
        *(["--remount-ro", "/tmp", "--remount-ro", "/dev"] if read_only else []), "--clearenv",
    ]  # fmt: skip


def start_template(tool: Path, loop: str) -> AnyTemplate:
    """The template of ``loop``: ``c``, ``python`` or ``frozen`` (``bench/_frozen.py``)."""
    if loop == "frozen":
        script = tool.parent / TEMPLATE.name
        if os.geteuid() != 0:  # rootless: bubblewrap as ourselves, no cgroup
            sandbox = sandbox_argv(tool, uid=os.getuid(), gid=os.getgid())
            return FrozenTemplate(tool, sandbox, PYTHON, script, None, (MEMORY_MB, MAX_PIDS))
        # A uid of its own, leased as the runner's sandboxes lease theirs: only the template
        # and its calls hold capabilities in the calls' user namespaces.
        lease = lease_identity()
        try:
            sandbox = sandbox_argv(tool, uid=lease.uid, gid=lease.gid)
            return FrozenTemplate(tool, sandbox, PYTHON, script, lease, (MEMORY_MB, MAX_PIDS))
        except BaseException:
            lease.release()
            raise
    return Template(tool, loop == "python")


class TemplateRefused(RuntimeError):
    """The template ended, or failed a check, before taking calls."""


class Template:
    """The tool's template in its sandbox, and the calls forked from it."""

    def __init__(self, tool: Path, python_loop: bool = False) -> None:
        self._cgroups = CgroupFactory()
        self._lock = threading.Lock()
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.setblocking(True)  # the loop's end must block, whatever default timeout is set
        seccomp = filter_fd(memory_counted=True)  # root, with a cgroup per call
        loop = ["--python-loop", str(seccomp)] if python_loop else [str(tool.parent / LOOP)]
        # Read-only: a call's own mounts cover /tmp, /dev/shm and /dev/pts, but a file it
        # could write in the template's /dev or /tmp (reached by ../ from its cwd) would be
        # there for the next call. The Python loop is kept as it was, without.
        argv = [
            *sandbox_argv(tool, read_only=not python_loop),
            "--", PYTHON, "-s", str(tool.parent / TEMPLATE.name), str(tool), str(theirs.fileno()), *loop,
        ]  # fmt: skip
        self.process = subprocess.Popen(argv, pass_fds=(theirs.fileno(), seccomp), stdin=subprocess.DEVNULL)
        control_inode = os.fstat(theirs.fileno()).st_ino
        theirs.close()
        os.close(seccomp)
        if not python_loop:
            try:
                self._ready(control_inode, tool)
            except BaseException:
                self.close()
                raise

    def _ready(self, control_inode: int, tool: Path) -> None:
        """Waits for the loop's ready, checks the template from outside, sends the filter."""
        readable, _, _ = select.select([self._control], [], [], 30)
        if not readable or self._control.recv(1) != b"r":
            raise TemplateRefused(f"no ready from the template (exit {self.process.wait(timeout=10)})")
        template = _sandboxed(self.process.pid)
        problem = _untrustworthy(template, control_inode)
        if problem:
            raise TemplateRefused(problem)
        program = compiled_filter(memory_counted=True)
        self._control.send(struct.pack("I", len(program)) + program + str(tool).encode() + b"\0")

    def call(self, payload: bytes) -> tuple[bytes, int]:
        """Stdout and the wait status of one call forked from the template."""
        group = self._cgroups.create(MEMORY_MB, MAX_PIDS)
        mine, theirs = socket.socketpair()
        theirs.setblocking(True)
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


AnyTemplate = Template | FrozenTemplate


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _descendants(roots: list[int]) -> list[int]:
    """``roots`` and every process under them (one that vanishes meanwhile: without its own)."""
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        with contextlib.suppress(FileNotFoundError):
            todo += _children(pid)
    return found


def _sandboxed(bwrap: int) -> tuple[int, int, list[int]]:
    """Bubblewrap's init in the sandbox, the template and every other process there."""
    (init,) = _children(bwrap)
    others = _descendants(_children(init))
    return init, others[0] if others else -1, others[1:]


def _untrustworthy(sandbox: tuple[int, int, list[int]], control_inode: int | None) -> str | None:
    """What the import left that would outlive it in the template, if anything."""
    init, template, others = sandbox
    if template < 0:
        return "no template process"
    if others:
        return f"processes besides the template: {others}"
    for kind in NAMESPACES:
        if os.stat(f"/proc/{template}/ns/{kind}").st_ino != os.stat(f"/proc/{init}/ns/{kind}").st_ino:
            return f"the template left bubblewrap's {kind} namespace"
    fds = os.listdir(f"/proc/{template}/fd")
    if control_inode is None:  # the frozen template keeps none
        if fds:
            return f"descriptors left: {fds}"
    elif len(fds) != 1 or os.readlink(f"/proc/{template}/fd/{fds[0]}") != f"socket:[{control_inode}]":
        return f"descriptors besides the control socket: {fds}"
    maps = Path(f"/proc/{template}/maps").read_text().splitlines()
    if any(line.split()[1][3] == "s" for line in maps):
        return "a shared mapping"
    return None


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
    parser.add_argument("--python-loop", action="store_true", help="the earlier loop, in Python")
    parser.add_argument("--frozen", action="store_true", help="the frozen template, cloned by ptrace")
    args = parser.parse_args()
    tool = tool_copy()
    template = start_template(tool, "frozen" if args.frozen else "python" if args.python_loop else "c")
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
