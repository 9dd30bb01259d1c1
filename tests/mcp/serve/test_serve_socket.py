"""``runner serve --socket``: who may call (peer credentials), what a peer can cost, where
the socket may live, and what the audit trail says."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import write_tool
from support.socket_server import Served, exchange, serving, start, starter, where_of

from runner.config.sockets import MAX_REQUEST_BYTES

NOBODY, OTHER = 65534, 65533
SYSTEM_PYTHON = "/usr/bin/python3"  # one that another uid can run (ours may live under /root)
SLEEPER = "import time\ntime.sleep(20)\nprint('{}')\n"
ADD = {"toolName": "add_numbers", "params": {"a": 1, "b": 2}}
SETTINGS = f"""
serve:
  socket:
    uids: {{{NOBODY}: user}}
    max_open: 4
    read_timeout_ms: 5000
"""


@pytest.fixture(scope="module")
def shared() -> Iterator[Served]:
    """A server that admits ``NOBODY`` as user, in a folder others may enter (not read)."""
    root = Path(tempfile.mkdtemp(prefix="runner-socket-"))
    root.chmod(0o711)
    folder = starter(root / "project", SETTINGS)
    write_tool(folder / "tools", "sleeper", SLEEPER, tags=["write"], limits={"timeout_ms": 30000})
    for path in (folder, *folder.rglob("*")):  # the admitted uid's `runner exec` reads the policy's path
        path.chmod(path.stat().st_mode | 0o005)
    (root / "run").mkdir(mode=0o711)
    with serving(folder, root / "run" / "serve.sock") as server:
        yield server


def as_uid(
    uid: int, code: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    if not Path(SYSTEM_PYTHON).is_file() or os.getuid() != 0:
        pytest.skip("needs root (setpriv) and a system python3 another uid can run")
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", SYSTEM_PYTHON, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


_RAW_CLIENT = """
import json, socket, sys
with socket.socket(socket.AF_UNIX) as conn:
    conn.connect(sys.argv[1])
    try:
        conn.sendall(sys.argv[2].encode() + b"\\n")
    except BrokenPipeError:  # refused before its request was read: the refusal waits to be read
        pass
    print(conn.makefile("rb").readline().decode(), end="")
"""


def line(request: Mapping[str, object], folder: Path) -> str:
    return json.dumps({"request": request, "where": where_of(folder)})


def test_the_socket_is_0666_only_when_other_uids_are_admitted(shared: Served, tmp_path: Path) -> None:
    assert stat.S_IMODE(shared.socket.stat().st_mode) == 0o666
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    folder = starter(tmp_path / "project")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("RUNNER_SOCKET", None)
    default = runtime / "runner" / "serve.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "runner", "serve", "--socket"], cwd=folder, env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not default.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert stat.S_IMODE(default.stat().st_mode) == 0o600
        assert stat.S_IMODE((runtime / "runner").stat().st_mode) == 0o700
        # runner exec finds it there unasked.
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "runner",
                "exec",
                "add_numbers",
                "--params",
                '{"a": 2, "b": 2}',
                "--request-id",
                "d1",
            ],
            cwd=folder,
            env=env,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert json.loads(done.stdout)["result"] == 4
        finished = [json.loads(x) for x in (folder / "audit.log").read_text().splitlines()]
        assert [
            e["client"] for e in finished if e.get("requestId") == "d1" and e["event"] == "call.finished"
        ] == [f"uid:{os.getuid()}"]
    finally:
        process.terminate()
        process.wait(timeout=30)
        assert process.stderr is not None
        process.stderr.close()
    assert not default.exists()  # the server removes its socket when it stops


def test_a_uid_not_admitted_is_refused_before_its_request_is_read(shared: Served) -> None:
    done = as_uid(OTHER, _RAW_CLIENT, str(shared.socket), line(ADD, shared.folder))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["refused"]["reason"] == "uid"
    refusals = [e for e in shared.audit() if e["event"] == "serve.socket"]
    assert refusals[-1]["decision"] == "deny" and refusals[-1]["peer"] == f"uid:{OTHER}"
    assert not any(e.get("client") == f"uid:{OTHER}" for e in shared.audit() if e["event"] != "serve.socket")


def test_an_admitted_uid_calls_with_its_role_and_is_audited_as_itself(shared: Served) -> None:
    # Its own `runner exec`, on a python with nothing but the standard library installed.
    env = {
        "PYTHONPATH": os.environ["PYTHONPATH"],
        "RUNNER_SOCKET": str(shared.socket),
        "RUNNER_POLICIES": str(shared.folder / "policies.yaml"),
        "HOME": "/nonexistent",
    }
    code = "import sys; sys.argv[0] = 'runner'; from runner.entry import main; main()"
    done = as_uid(
        NOBODY, code, "exec", "add_numbers", "--params", '{"a": 1, "b": 2}', "--request-id", "n1", env=env
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == 3
    assert shared.finished("n1")["client"] == f"uid:{NOBODY}"
    assert shared.finished("n1")["role"] == "user"
    # Another role than its own is not taken.
    admin = as_uid(NOBODY, _RAW_CLIENT, str(shared.socket), line({**ADD, "role": "admin"}, shared.folder))
    assert json.loads(admin.stdout)["refused"]["reason"] == "role"


def test_the_servers_own_user_calls_with_the_role_it_asks_for(shared: Served) -> None:
    request = {  # write_file: the admin's (tag:write) and needs no approval, unlike delete_file
        "toolName": "write_file",
        "params": {"path": "socket-own-admin.txt", "content": "x"},
        "requestId": "own-admin",
        "role": "admin",
    }
    reply = exchange(shared.socket, line(request, shared.folder).encode() + b"\n")
    assert reply is not None and reply["answer"]["success"], reply
    assert shared.finished("own-admin")["role"] == "admin"
    denied = exchange(
        shared.socket,
        line({**request, "role": "user", "requestId": "own-user"}, shared.folder).encode() + b"\n",
    )
    assert denied is not None and denied["answer"]["error"]["code"] == "PERMISSION_DENIED"


def test_connections_beyond_the_cap_are_closed_unread_and_idle_ones_time_out(shared: Served) -> None:
    held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(4)]
    try:
        for conn in held:
            conn.connect(str(shared.socket))
        time.sleep(0.3)  # the server has accepted them all
        reply = exchange(shared.socket, line(ADD, shared.folder).encode() + b"\n")
        assert reply is not None and reply["refused"]["reason"] == "busy"
        for conn in held:  # read_timeout_ms: each is closed without an answer
            conn.settimeout(30)
            assert conn.recv(100) == b""
    finally:
        for conn in held:
            conn.close()
    reply = exchange(shared.socket, line(ADD, shared.folder).encode() + b"\n")
    assert reply is not None and reply["answer"]["result"] == 3


def test_the_socket_holds_no_more_connections_than_its_share_of_the_descriptor_limit(tmp_path: Path) -> None:
    folder = starter(
        tmp_path / "project", "\nserve:\n  socket:\n    max_open: 4096\n    read_timeout_ms: 5000\n"
    )
    path = tmp_path / "serve.sock"
    process = start(folder, path, prefix=["prlimit", "--nofile=128:128"])
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while not path.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        _listening(path)
        for _ in range(100):  # idle, as a local user's flood would hold them
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(conn)
            conn.connect(str(path))
        busy = 0
        for conn in held:
            conn.settimeout(2)
            with contextlib.suppress(TimeoutError):  # else held by the server: a slot of its share
                busy += b'"busy"' in conn.recv(1000)
        # 128 descriptors: the listener may hold 64 (half); the rest are turned away at once.
        assert busy >= 30, busy
        for conn in held:
            conn.close()
        reply = exchange(path, line(ADD, folder).encode() + b"\n")
        assert reply is not None and reply["answer"]["result"] == 3
    finally:
        for conn in held:
            conn.close()
        process.send_signal(signal.SIGTERM)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
    assert b"serve.socket.max_open lowered to 64" in err, err


_HOLDER = """
import socket, sys
held = [socket.socket(socket.AF_UNIX) for _ in range(4)]
busy = 0
for conn in held:
    conn.connect(sys.argv[1])
    conn.settimeout(0.5)
    try:
        busy += b'"busy"' in conn.recv(1000)
    except TimeoutError:  # held by the server, waiting for a request line
        pass
print(busy, flush=True)
sys.stdin.read()
"""


def test_an_admitted_uid_holds_half_the_connections_and_never_locks_out_the_servers_user(
    shared: Served,
) -> None:
    # The cap was global: an admitted uid held every slot with idle connections, and the
    # server's own user was refused busy (runner exec then ran directly, silently).
    if not Path(SYSTEM_PYTHON).is_file() or os.getuid() != 0:
        pytest.skip("needs root (setpriv) and a system python3 another uid can run")
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", SYSTEM_PYTHON]
    with subprocess.Popen(
        [*argv, "-c", _HOLDER, str(shared.socket)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        busy = int(holder.stdout.readline())
        reply = exchange(shared.socket, line(ADD, shared.folder).encode() + b"\n")
        holder.stdin.close()
    assert busy == 2, f"{4 - busy} of 4 held by one uid (max_open 4)"
    assert reply is not None and reply.get("answer", {}).get("result") == 3, reply


def test_a_client_that_shuts_its_writing_side_after_the_request_still_gets_its_answer(
    shared: Served,
) -> None:
    # End of input was taken for the client's going away: its call was cancelled, and a
    # client of one-request tools (nc -N, socat) got no answer.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(60)
        conn.connect(str(shared.socket))
        conn.sendall(line(ADD, shared.folder).encode() + b"\n")
        conn.shutdown(socket.SHUT_WR)
        reply = conn.makefile("rb").readline()
    assert json.loads(reply)["answer"]["result"] == 3, reply


def test_a_request_line_over_the_bound_is_refused(shared: Served) -> None:
    reply = exchange(shared.socket, b"x" * (MAX_REQUEST_BYTES + 2))
    assert reply is not None and reply["refused"]["reason"] == "too_large"


def test_a_request_line_of_too_many_objects_is_refused_before_it_is_parsed(shared: Served) -> None:
    # 16 MiB of "{}," took the server 6 s and 1.1 GB to parse, its other clients waiting.
    empties = "[" + ",".join(["{}"] * 1_200_000) + "]"
    request = {"toolName": "add_numbers", "params": {"a": 1, "b": 1, "c": "PLACE"}}
    data = line(request, shared.folder).replace('"PLACE"', empties).encode() + b"\n"
    reply = exchange(shared.socket, data)
    assert reply is not None and reply["refused"]["reason"] == "too_large", reply
    assert "objects and arrays" in reply["refused"]["message"]
    fine = exchange(
        shared.socket,
        line({"toolName": "add_numbers", "params": {"a": 1, "b": 2}}, shared.folder).encode() + b"\n",
    )
    assert fine is not None and fine["answer"]["success"], fine


def _peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(row for row in status.splitlines() if row.startswith("VmHWM:")).split()[1]) / 1024


def _four_at_once(shared: Served, params: bytes) -> tuple[list[dict[str, Any] | None], float]:
    """Four request lines of add_numbers whose param ``c`` is ``params``, sent at once: the
    replies, and how much the server's peak memory grew (MB)."""
    request = {"toolName": "add_numbers", "params": {"a": 1, "b": 1, "c": "PLACE"}}
    head, tail = line(request, shared.folder).encode().split(b'"PLACE"')
    data = head + params + tail + b"\n"
    before = _peak_rss_mb(shared.process.pid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: exchange(shared.socket, data, timeout_s=120), range(4)))
    grown = _peak_rss_mb(shared.process.pid) - before
    print(f"peak RSS grew by {grown:.0f} MB")
    return replies, grown


def test_large_request_lines_at_once_are_parsed_one_by_one_and_refused_before_a_slot(shared: Served) -> None:
    # Lines of a flat array of 8 million numbers: each was parsed on the event loop and
    # held while the runner's own check walked it there, seconds per line, every client
    # waiting, and a gigabyte for eight connections.
    replies, grown = _four_at_once(shared, b"[" + b"0," * (6 * 1024 * 1024) + b"0]")  # 12 MiB
    refusals = [reply["refused"] if reply else None for reply in replies]
    assert all(refused and refused["reason"] in ("too_large", "busy") for refused in refusals), refusals
    assert any(refused and "larger than 8388608" in refused["message"] for refused in refusals), refusals
    assert grown < 300, f"the server's peak memory grew by {grown:.0f} MB"


def test_large_request_lines_within_the_params_bound_are_served_one_at_a_time(shared: Served) -> None:
    # Lines under the 8 MiB of params passed the check, and every connection held its
    # parsed request at once while it waited: four lines of short strings, half a gigabyte.
    replies, grown = _four_at_once(shared, b"[" + b'"ab",' * (6 * 1024 * 1024 // 6) + b'"ab"]')
    for reply in replies:  # refused busy, or answered (its params are not add_numbers')
        assert reply is not None, reply
        assert "answer" in reply or reply["refused"]["reason"] == "busy", str(reply)[:300]
    assert any("refused" in reply for reply in replies if reply), "four large lines were held at once"
    assert grown < 300, f"the server's peak memory grew by {grown:.0f} MB"


@pytest.mark.parametrize(
    "data",
    [
        b'{"request": {"toolName": "add_numbers", "params": {"a": NaN, "b": 1}}, "where": WHERE}\n',
        b"not json\n",
        b'{"request": [], "where": WHERE}\n',
        b'{"request": {}, "where": WHERE, "more": 1}\n',
        b'{"request": {}, "where": {"policies": "/x"}}\n',
    ],
)
def test_what_is_not_a_strict_request_line_is_refused(shared: Served, data: bytes) -> None:
    data = data.replace(b"WHERE", json.dumps(where_of(shared.folder)).encode())
    reply = exchange(shared.socket, data)
    assert reply is not None and reply["refused"]["reason"] == "bad_request"


def test_a_request_for_another_policy_is_refused_as_elsewhere(shared: Served, tmp_path: Path) -> None:
    reply = exchange(shared.socket, line(ADD, tmp_path).encode() + b"\n")
    assert reply is not None and reply["refused"]["reason"] == "elsewhere"


def test_a_planted_symlink_or_a_live_server_at_the_path_is_left_alone(shared: Served, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    target = tmp_path / "target"
    planted = run / "serve.sock"
    planted.symlink_to(target)
    for path in (planted, shared.socket):
        process = start(shared.folder, path)
        _, err = process.communicate(timeout=120)
        assert process.returncode == 2, err
        assert b"Traceback" not in err
    assert planted.is_symlink() and not target.exists()
    assert shared.process.poll() is None  # the live server still serves


def test_a_folder_others_can_write_to_is_refused(shared: Served, tmp_path: Path) -> None:
    run = tmp_path / "open"
    run.mkdir()
    run.chmod(0o777)
    process = start(shared.folder, run / "serve.sock")
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and b"mode 0777" in err
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "run-target", target_is_directory=True)
    (tmp_path / "run-target").mkdir(mode=0o700)
    process = start(shared.folder, linked / "serve.sock")
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and b"not a folder" in err
    assert not (tmp_path / "run-target" / "serve.sock").exists()


def test_a_client_that_goes_away_cancels_its_call(shared: Served) -> None:
    request = {
        "toolName": "sleeper",
        "params": {},
        "role": "admin",
        "requestId": "gone",
        "options": {"deadline": 25000, "timeout": 25000, "retries": 0},
    }
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(shared.socket))
        conn.sendall(line(request, shared.folder).encode() + b"\n")
        deadline = time.monotonic() + 30
        while not any(e.get("requestId") == "gone" for e in shared.audit()) and time.monotonic() < deadline:
            time.sleep(0.1)  # the call has begun
        time.sleep(1)
    deadline = time.monotonic() + 30
    finished: list[dict[str, object]] = []
    while not finished and time.monotonic() < deadline:
        finished = [
            e for e in shared.audit() if e.get("requestId") == "gone" and e["event"] == "call.finished"
        ]
        time.sleep(0.2)
    assert finished and finished[0]["cancelled"] is True
    assert finished[0]["client"] == f"uid:{os.getuid()}"
    assert isinstance(finished[0]["duration"], int) and finished[0]["duration"] < 15000  # not the tool's 20 s


def test_beside_stdio_the_socket_serves_until_the_mcp_clients_input_ends(tmp_path: Path) -> None:
    folder = starter(tmp_path / "project")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = run / "serve.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "runner", "serve", "--stdio", "--socket", str(path)],
        cwd=folder,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        _listening(path)
        reply = exchange(path, line({**ADD, "requestId": "beside"}, folder).encode() + b"\n")
        assert reply is not None and reply["answer"]["result"] == 3
        assert process.stdin is not None
        process.stdin.close()  # the MCP client is gone: the whole server stops
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not path.exists()


def test_beside_http_both_serve_and_sigterm_stops_both(tmp_path: Path) -> None:
    folder = starter(tmp_path / "project")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with serving(folder, run / "serve.sock", "--http", "127.0.0.1:0") as server:
        reply = exchange(server.socket, line({**ADD, "requestId": "beside-http"}, folder).encode() + b"\n")
        assert reply is not None and reply["answer"]["result"] == 3
        assert server.finished("beside-http")["client"] == f"uid:{os.getuid()}"
    assert server.process.returncode == 0
    assert not server.socket.exists()


def test_snake_case_keys_meet_the_same_checks_as_camel_case_ones(shared: Served) -> None:
    # The runner takes tool_name as well as toolName: the server's own checks (approval,
    # the slot) must see the tool either way.
    snake = {"tool_name": "delete_file", "params": {"path": "x.txt"}, "role": "admin"}
    reply = exchange(shared.socket, line(snake, shared.folder).encode() + b"\n")
    assert reply is not None and reply["refused"]["reason"] == "approval", reply
    both = {**snake, "toolName": "add_numbers"}
    reply = exchange(shared.socket, line(both, shared.folder).encode() + b"\n")
    assert reply is not None and reply["refused"]["reason"] == "bad_request", reply


def _listening(path: Path) -> None:
    """Until the server listens on ``path`` (its file is there from the bind, a moment
    before)."""
    deadline = time.monotonic() + 30
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
                return
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.05)
