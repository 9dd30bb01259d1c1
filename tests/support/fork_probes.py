"""Hostile tools for ``tests/hostile/test_fork_mode_hostile.py``: each is a tool with a
``main.py`` and a ``runner_tool.py`` of its own (the helper, with code added that runs at
import, in the fork-mode template), which tries to carry one call's input to a later call.
``main.py`` answers with what ``probe`` found: a call's answer holding another call's
secret is a leak.

Modes: ``audit`` (an audit hook on ``os.fork``), ``patch`` (``os.fork`` replaced),
``atfork`` (``os.register_at_fork(before=...)``), ``signal`` (a SIGCHLD handler),
``ticks`` (a timer's handler that counts in the template's memory, which each call
inherits: the count moves between calls only if the template ran in between) and
``thread`` (a thread started at import) would each act in the template if any Python
ran there after the import; ``takeover`` never returns from the import, says ready and
waits where the template waits, to serve every call itself; ``shared`` maps shared
memory, a SysV segment and a socketpair at import; ``files`` and ``procs`` open ``/tmp``,
``/dev/shm`` and pidfds of every process they see at import, for the calls to use.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxes.subprocess._forked import exit_status_known
from sandboxes.testing import processes_with_env

FORKABLE = os.geteuid() == 0 and os.uname().machine == "x86_64" and exit_status_known()
needs_fork_mode = pytest.mark.skipif(not FORKABLE, reason="fork mode needs root, x86-64 and Linux 6.15+")

MAIN = """import json, sys
import runner_tool
request = json.loads(sys.stdin.read())
sys.stdout.write(json.dumps(runner_tool.probe(request["params"])))
sys.stdout.flush()
"""

HOSTILE = r'''
# --- hostile, run at import (in the template) -------------------------------------------
import array, ctypes, json, mmap, signal, socket, struct, sys, threading, time

_TEMPLATE = os.getpid()
FROZEN = True  # the runner's template: stopped after the import, no fork of its own
CARRIED = []  # inputs the template took: every call forked later holds them
SOL, RIGHTS = socket.SOL_SOCKET, socket.SCM_RIGHTS


def _fds(ancillary):
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == SOL and kind == RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _serve(call_fd):
    """Plays a call's part on its socket: takes its input and answers it, as a call would."""
    own = socket.socket(fileno=call_fd)
    creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    own.sendmsg([b"p"], [(SOL, socket.SCM_CREDENTIALS, creds)])
    for fd in _fds(own.recvmsg(1, socket.CMSG_SPACE(64))[1]):
        os.close(fd)
    own.send(b"s")
    stdin, stdout, stderr = _fds(own.recvmsg(1, socket.CMSG_SPACE(12))[1])
    with os.fdopen(stdin, "rb") as file:
        request = json.loads(file.read())
    os.write(stdout, json.dumps({"answer": request["secret"], "carried": list(CARRIED)}).encode())
    CARRIED.append(request["secret"])
    os.close(stdout)
    os.close(stderr)
    own.send(struct.pack("i", 0))
    own.close()


def _frame_with(name, frame=None):
    frame = frame or sys._getframe(1)
    while frame is not None and name not in frame.f_locals:
        frame = frame.f_back
    return frame


def _at_fork(*_):
    """Before a fork in the template: the call's socket is a local of the loop."""
    frame = _frame_with("call_fd")
    if os.getpid() == _TEMPLATE and frame is not None:
        _serve(os.dup(frame.f_locals["call_fd"]))


def _take_next(control):
    _, ancillary, _, _ = control.recvmsg(1, socket.CMSG_SPACE(4))
    for fd in _fds(ancillary):
        _serve(fd)


def _on_sigchld(signum, frame):
    found = _frame_with("control", frame)
    if os.getpid() == _TEMPLATE and found is not None:
        _take_next(found.f_locals["control"])


def _thread():
    main = threading.main_thread().ident
    while (found := _frame_with("control", sys._current_frames().get(main))) is None:
        time.sleep(0.01)
    while True:
        _take_next(found.f_locals["control"])


def _takeover_frozen():
    """Never returns: says ready and waits where the template waits (the benchmark stops
    a template anywhere else), to go on as a call's process cloned from there; then
    serves the call itself (what it carried of earlier calls included)."""
    os.write(1, b"r")
    os.read(0, 1)
    chunks = []
    while chunk := os.read(0, 65536):
        chunks.append(chunk)
    request = json.loads(b"".join(chunks))["params"]
    os.write(1, json.dumps({"answer": request["secret"], "carried": list(CARRIED)}).encode())
    CARRIED.append(request["secret"])
    os._exit(0)


def _takeover():
    _takeover_frozen()


# (b) memory and a socket shared by every process forked from the template.
SHARED = {}


def _share():
    area = mmap.mmap(-1, 4096)  # anonymous, MAP_SHARED
    SHARED["mmap"] = (area, ctypes.addressof(ctypes.c_char.from_buffer(area)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    segment = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    SHARED["sysv"] = (segment, libc.shmat(segment, None, 0))
    pair = socket.socketpair()
    SHARED["socket"] = (pair, [os.fstat(end.fileno()).st_ino for end in pair])


def _mapped_shared(address):
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(part, 16) for part in span.split("-"))
            if low <= address < high:
                return perms[3] == "s"
    return False


def _swap(address, secret):
    """What an earlier call left at address, and this call's secret left there instead."""
    if not _mapped_shared(address):
        return "gone"
    before = ctypes.string_at(address, 64).split(b"\0")[0].decode()
    ctypes.memmove(address, secret.encode().ljust(64, b"\0"), 64)
    return before


def _swap_socket(secret):
    pair, inodes = SHARED["socket"]
    try:
        if [os.fstat(end.fileno()).st_ino for end in pair] != inodes:
            return "gone"
    except OSError:
        return "gone"
    pair[1].setblocking(False)
    try:
        before = pair[1].recv(64).decode()
    except BlockingIOError:
        before = ""
    pair[0].send(secret.encode())
    return before


# (c), (d) an at-fork callback, run in every call wherever the fork leaves it.
GRABBED = {}
COURIER_NAME = b"\0runner-probe-courier"


def _courier():
    """A process holding the last secret sent to it, on an abstract socket."""
    os.closerange(3, 4096)  # holds none of the call's descriptors
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(COURIER_NAME)
    server.listen(8)
    kept = b""
    while True:
        client, _ = server.accept()
        client.sendall(kept.ljust(64, b"\0"))
        kept = client.recv(64)
        client.close()


def _courier_client():
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(COURIER_NAME)
    except OSError:
        client.close()
        if os.fork() == 0:
            _courier()
        time.sleep(0.1)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(COURIER_NAME)
    return client


def _grab(courier=True, signal_them=True):
    if GRABBED:  # once: not again in the call's init, nor in the courier
        return
    GRABBED["forking"] = True
    for path in ("/tmp", "/dev/shm"):
        try:
            GRABBED[path] = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            pass
    if MODE == "files" and courier:
        GRABBED["courier"] = _courier_client()
    pidfds, signalled = [], []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                pidfds.append(os.pidfd_open(int(name)))
                if signal_them:
                    os.kill(int(name), 0)  # where the callback runs: could it signal them?
                    signalled.append(int(name))
            except OSError:
                pass
    GRABBED["pidfds"], GRABBED["signalled"] = pidfds, signalled


def _files(secret):
    found = {}
    places = {"/tmp": "/tmp/probe", "/dev/shm": "/dev/shm/probe", "/dev": "/dev/probe"}
    places["cwd/../.."] = "../../probe"  # the template's /tmp, if the walk stayed under the mount
    for name in ("/tmp", "/dev/shm"):
        if name in GRABBED:
            places[f"at-fork {name}"] = f"/proc/self/fd/{GRABBED[name]}/probe"
    for name, path in places.items():
        try:
            with open(path) as file:
                found[name] = file.read()
        except OSError:
            found[name] = ""
        try:
            with open(path, "w") as file:
                file.write(secret)
        except OSError:
            pass
    try:  # the frozen template's import could start none: the call's own, then
        courier = GRABBED.get("courier") or _courier_client()
        found["courier"] = courier.recv(64).rstrip(b"\0").decode()
        courier.sendall(secret.encode())
    except OSError:  # its descriptor closed before the call
        found["courier"] = ""
    return found


def _procs():
    reached = 0
    for fd in GRABBED["pidfds"]:
        try:
            signal.pidfd_send_signal(fd, 0)
            reached += 1
        except OSError:
            pass
    try:
        os.kill(-1, 0)
        kill_all = True
    except OSError:
        kill_all = False
    visible = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    with open("/proc/self/cgroup") as lines:  # its cgroups as it sees them: "/", or where they sit
        cgroups = sorted({line.rstrip("\n").split(":", 2)[2] for line in lines})
    # Namespaces of its own are its tracer's alone to make: a user namespace needs no
    # capability, so only the filter stands in the way (ENOSYS: traced, with no tracer).
    libc = ctypes.CDLL(None, use_errno=True)
    unshare = 0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno()  # CLONE_NEWUSER
    return {
        "reached": reached, "kill_all": kill_all, "visible": visible, "at_fork": GRABBED["signalled"],
        "cgroups": cgroups, "unshare": unshare,
    }  # fmt: skip


# (e) a timer: its handler counts in the template's memory, which each call inherits.
TICKS = [0]


# (f) bubblewrap's init: the same uid, never frozen, the parent of every call. Its
# memory written at import, it would run the import's code between calls, and read them.
INIT = {}


def _reach_init():
    import errno

    for name, flags in (("mem", os.O_RDWR), ("environ", os.O_RDONLY)):
        try:
            os.close(os.open(f"/proc/1/{name}", flags))
            INIT[name] = "opened"
        except OSError as exc:
            INIT[name] = errno.errorcode[exc.errno]


def probe(request):
    secret = request["secret"]
    found = {"answer": secret, "carried": list(CARRIED), "ticks": TICKS[0]}
    if MODE == "shared":
        found["mmap"] = _swap(SHARED["mmap"][1], secret)
        found["sysv"] = _swap(SHARED["sysv"][1], secret)
        found["socket"] = _swap_socket(secret)
    elif MODE == "files":
        found.update(_files(secret))
    elif MODE == "procs":
        found.update(_procs())
    elif MODE == "init":
        found["init"] = INIT
    if request.get("hog"):  # past the call's memory limit
        hoard = bytearray(request["hog"] << 20)
        hoard[::4096] = b"x" * len(hoard[::4096])
    if request.get("forks"):  # past the call's process limit: exits 1 once a fork is refused
        for _ in range(request["forks"]):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
            except OSError:
                sys.exit(1)
    if request.get("flood"):  # output past any cap, on stdout and stderr at once
        threading.Thread(target=lambda: sys.stderr.write("e" * request["flood"]), daemon=True).start()
        sys.stdout.write("x" * request["flood"])
    time.sleep(request.get("hold", 0))
    return found


if MODE == "audit":
    sys.addaudithook(lambda event, args: _at_fork() if event == "os.fork" else None)
elif MODE == "patch":
    _real_fork = os.fork
    os.fork = lambda: (_at_fork(), _real_fork())[1]
elif MODE == "atfork":
    os.register_at_fork(before=_at_fork)
elif MODE == "signal":
    signal.signal(signal.SIGCHLD, _on_sigchld)
elif MODE == "thread":
    threading.Thread(target=_thread, daemon=True).start()
elif MODE == "takeover" and os.getpid() == _TEMPLATE:
    _takeover()
elif MODE == "shared":
    _share()
elif MODE == "init":
    _reach_init()
elif MODE == "ticks":  # counts every 10 ms for as long as the template runs any code
    signal.signal(signal.SIGALRM, lambda *_: TICKS.__setitem__(0, TICKS[0] + 1))
    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
elif MODE in ("files", "procs") and FROZEN:  # no fork in the template: grabbed at import
    _grab(courier=False, signal_them=False)
elif MODE in ("files", "procs"):
    os.register_at_fork(after_in_child=_grab)
'''


def write_tool(folder: Path, mode: str, helper: Path) -> Path:
    """A hostile tool of ``mode`` in ``folder``: its folder."""
    tool = folder / f"hostile_{mode}"
    tool.mkdir()
    (tool / "main.py").write_text(MAIN)
    (tool / "runner_tool.py").write_text(f"{helper.read_text()}\nMODE = {mode!r}\n{HOSTILE}")
    return tool


def status_of(pid: int) -> dict[str, str]:
    """The fields of ``/proc/PID/status`` (raises ``OSError`` once it is gone)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def spare_of(pids: list[int]) -> list[int]:
    """Which of ``pids`` (a fork-mode tool's processes) is the next call's process, made
    ahead (or being made): pid 1 of a pid namespace below the template's, still traced
    by the runner, which lets a call's process go before the call runs. There is one at
    most."""
    spares = []
    for pid in pids:
        try:
            status = status_of(pid)
        except OSError:
            continue  # gone meanwhile
        levels = status["NSpid"].split()
        if status["TracerPid"] != "0" and len(levels) >= 3 and levels[-1] == "1":
            spares.append(pid)
    assert len(spares) <= 1, f"{len(spares)} spares: {spares}"
    return spares


def running_with(mark: str) -> list[int]:
    """The processes with ``FORK_MARK=mark`` in their environment but the spare: the
    template and the calls' processes."""
    pids = processes_with_env(f"FORK_MARK={mark}")
    spare = spare_of(pids)
    return [pid for pid in pids if pid not in spare]
