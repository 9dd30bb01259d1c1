"""A pre-imported template that forks each call into fresh namespaces: the mechanics of a
fork mode, run by ``bench/fork_floor.py`` inside bubblewrap to measure them. Not part of
the runner: no tool is ever run this way by it.

    python3 -s _fork_template.py TOOL_DIR CONTROL_FD LOOP_SO
    python3 -s _fork_template.py TOOL_DIR CONTROL_FD --python-loop FILTER_FD
    python3 -s _fork_template.py TOOL_DIR --frozen

The template compiles (never runs) the tool's ``main.py``, imports its helper and then
enters ``runner_fork_loop`` of LOOP_SO (``bench/_fork_loop.c``), which never comes back
to Python in the template: it checks it is the only thread, blocks every signal, closes
every descriptor but CONTROL_FD (a SOCK_SEQPACKET socket), unmaps every shared mapping,
says it is ready and receives the seccomp program and the tool's folder from the runner.
Then each message carries one descriptor, the call's own socket; for each it forks and
reaps the calls that have ended (it keeps no state of a call). The call's first process
then, in C, over its own socket:

1. sends its pid (SCM_CREDENTIALS, which the kernel translates into the runner's pid
   namespace) and receives the call cgroup's ``tasks`` files, opened by the runner;
   writes ``0`` to each (it joins; the kernel checks the opener's rights) and closes them;
2. unshares user, mount, pid, IPC, network and UTS namespaces (its own user namespace
   maps only its uid: the one the template runs as) and forks the call's init;
3. waits for it and sends its wait status, the runner's one way to learn it.

The call's init (pid 1 of its namespace) mounts a fresh ``/tmp``, ``/dev/shm`` and
``/proc`` (of its own pid namespace), enters the tool's folder, sets no_new_privs, loads
the seccomp filter (which refuses ``unshare``, ``mount`` and ``ptrace``), says it is
sealed, and only then receives stdin, stdout and stderr, restores the signal mask and
runs the interpreter's after-fork work (``PyOS_AfterFork_Child``: the tool's at-fork
callbacks run there, sealed) before Python runs the tool's ``main.py``.

``--frozen`` only imports, says ready and blocks: ``bench/_frozen.py`` clones each call
from it with ptrace, and it never runs again. ``--python-loop`` is the earlier loop, in
Python, with the filter from FILTER_FD: kept so that ``bench/test_fork_hostile.py`` can
show what each of its probes catches there.
"""

from __future__ import annotations

import array
import ctypes
import gc
import os
import socket
import struct
import sys
import types

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
FRESH = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
EXIT_SETUP = 125  # a step before the tool's code failed
LIBC = ctypes.CDLL(None, use_errno=True)


class _Program(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def _seal(program: bytes) -> None:
    """Fresh /tmp, no new privileges, the filter: what the tool's code runs under."""
    if LIBC.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        os._exit(EXIT_SETUP)
    for target in (b"/tmp", b"/dev/shm"):
        if LIBC.mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=16m,mode=1777") != 0:
            os._exit(EXIT_SETUP)
    # Its own pid namespace's processes only: not the template's, nor its siblings'.
    if LIBC.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        os._exit(EXIT_SETUP)
    code = ctypes.create_string_buffer(program, len(program))
    fprog = _Program(len(program) // 8, ctypes.cast(code, ctypes.c_void_p))
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        os._exit(EXIT_SETUP)
    if LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        os._exit(EXIT_SETUP)


def _call(own: socket.socket, code: types.CodeType, program: bytes) -> None:
    creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    own.sendmsg([b"p"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
    _, ancillary, _, _ = own.recvmsg(1, socket.CMSG_SPACE(16 * 4))
    for fd in _fds(ancillary):
        os.write(fd, b"0")  # joins the call cgroup
        os.close(fd)
    uid, gid = os.getuid(), os.getgid()
    if LIBC.unshare(FRESH) != 0:
        os._exit(EXIT_SETUP)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    init = os.fork()
    if init:
        _, status = os.waitpid(init, 0)
        own.send(struct.pack("i", status))
        os._exit(0)
    _seal(program)
    own.send(b"s")
    _, ancillary, _, _ = own.recvmsg(1, socket.CMSG_SPACE(3 * 4))
    std = _fds(ancillary)
    if len(std) != 3:
        os._exit(EXIT_SETUP)
    for number, fd in enumerate(std):
        os.dup2(fd, number)
        os.close(fd)
    own.close()
    _run(code)


def _reap() -> None:
    """Reap the calls that have ended (each sent its status itself; nothing is kept)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _python_loop(code: types.CodeType, control_fd: int, filter_fd: int) -> None:
    """The first prototype's loop, kept so that the probes can show what they catch."""
    import runner_tool  # type: ignore[import-not-found]  # noqa: F401 - the tool's imports, done once here

    program = os.pread(filter_fd, os.fstat(filter_fd).st_size, 0)
    os.close(filter_fd)
    gc.freeze()  # the collector would touch, and so copy, every page of the template
    control = socket.socket(fileno=control_fd)
    while True:
        message, ancillary, _, _ = control.recvmsg(1, socket.CMSG_SPACE(4))
        if not message:
            os._exit(0)
        (call_fd,) = _fds(ancillary)
        if os.fork() == 0:
            control.close()
            _call(socket.socket(fileno=call_fd), code, program)
        os.close(call_fd)
        _reap()


def _run(code: types.CodeType) -> None:
    """The tool's ``main.py``, in a sealed call that holds its stdio."""
    helper = sys.modules["runner_tool"]
    # It noted at import what fds 0-2 were, to know at exit that nothing else is open.
    helper._STANDARD_FDS = {fd: helper._identity(fd) for fd in (0, 1, 2)}
    sys.argv = ["main.py"]
    exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
    os._exit(0)


def _frozen(code: types.CodeType) -> None:
    """The frozen template (``bench/_frozen.py``): import, say ready, block in a read. The
    benchmark stops it there for good; each call's process returns from that read."""
    import runner_tool  # type: ignore[import-not-found]  # noqa: F401 - the tool's imports, done once here

    gc.freeze()
    os.write(1, b"r")
    os.read(0, 1)  # in the template: never returns (nothing is written, and it is stopped)
    _run(code)


def main() -> None:
    tool_dir = sys.argv[1]
    os.chdir(tool_dir)
    sys.path.insert(0, tool_dir)
    if sys.argv[2] == "--frozen":
        with open("main.py", "rb") as file:
            source = file.read()
        _frozen(compile(source, "main.py", "exec"))
    control_fd, loop = int(sys.argv[2]), sys.argv[3]
    # Compiled and resolved before the import, so that none of the tool's code runs around
    # them; what still runs after the import is the ctypes call into the loop (the gap
    # docs/performance.md describes: the import can take that over).
    with open("main.py", "rb") as file:
        code = compile(file.read(), "main.py", "exec")
    if loop == "--python-loop":
        _python_loop(code, control_fd, int(sys.argv[4]))
    fork_loop = ctypes.PyDLL(loop).runner_fork_loop  # PyDLL: the GIL stays held
    fork_loop.argtypes, fork_loop.restype = (ctypes.c_int,), ctypes.c_int
    import runner_tool  # type: ignore[import-not-found]  # noqa: F401 - the tool's imports, done once here

    gc.freeze()  # the collector would touch, and so copy, every page of the template
    fork_loop(control_fd)  # returns only in a call's init, sealed
    _run(code)


if __name__ == "__main__":
    main()
