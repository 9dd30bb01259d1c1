"""``runner exec`` through ``runner serve --socket``: the same bytes and exit status as the
direct path, the standard library alone on the way, and the direct path whenever the server
would not give the direct path's answer."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.socket_server import Served, serving, starter

# What differs between any two calls, whichever path: normalised before comparing bytes.
_VARYING = (
    (re.compile(rb'"duration": \d+'), b'"duration": 0'),
    (re.compile(rb'"timestamp": "[^"]+"'), b'"timestamp": "T"'),
    (re.compile(rb'"traceId": "[0-9a-f]{32}"'), b'"traceId": "X"'),
)
CASES = {
    "success": ["add_numbers", "--params", '{"a": 1, "b": 2.5}'],
    "tool_error": ["read_file", "--params", '{"path": "missing.txt"}', "--retries", "0"],
    "denied": ["delete_file", "--params", '{"path": "x.txt"}'],
    "bad_params": ["add_numbers", "--params", '{"a": "x"}'],
    "unknown_tool": ["add_number", "--params", "{}"],
    "options": ["echo", "--params=@params.json", "--timeout", "4000", "--format", "raw", "--step-id", "s1"],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("forward")
    folder = starter(root / "project")
    (folder / "params.json").write_text('{"message": "h\\u00e9llo \\"there\\""}')
    run = root / "run"
    run.mkdir(mode=0o700)
    with serving(folder, run / "serve.sock") as server:
        yield server


def run_exec(
    served: Served, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "runner", "exec", *args],
        cwd=cwd or served.folder,
        env=env or served.env(),
        capture_output=True,
        timeout=120,
        check=False,
    )


def normalised(stdout: bytes) -> bytes:
    for pattern, fixed in _VARYING:
        stdout = pattern.sub(fixed, stdout)
    return stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_socket_prints_the_direct_paths_bytes_and_exit_status(served: Served, case: str) -> None:
    args = CASES[case]
    through = run_exec(served, *args, "--request-id", f"sock-{case}")
    direct = run_exec(served, *args, "--request-id", f"direct-{case}", "--direct")
    assert through.returncode == direct.returncode, (through.stderr, direct.stderr)
    assert normalised(through.stdout).replace(b"sock-", b"direct-") == normalised(direct.stdout)
    assert through.stdout.endswith(b"\n") and through.stdout.count(b"\n") == 1
    assert served.finished(f"sock-{case}")["client"] == f"uid:{os.getuid()}"  # it went through the server
    assert "client" not in served.finished(f"direct-{case}")


def test_exit_statuses_follow_the_answer(served: Served) -> None:
    assert run_exec(served, *CASES["success"]).returncode == 0
    failed = run_exec(served, *CASES["denied"])
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["error"]["code"] == "PERMISSION_DENIED"


def test_the_forwarding_path_imports_the_standard_library_alone(served: Served) -> None:
    probe = (
        "import json, sys\n"
        "sys.argv = ['runner', 'exec', 'add_numbers', '--params', '{\"a\": 1, \"b\": 2}', '--request-id', 'lean']\n"
        "from runner.entry import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.stdout.flush()\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=served.folder, env=served.env(), capture_output=True, check=False
    )
    assert json.loads(done.stdout)["result"] == 3
    loaded = json.loads(done.stderr.splitlines()[-1])
    # What the interpreter loads before any code (site's .pth hooks, say) is not the call's.
    bare = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sorted(sys.modules)))"],
        env=served.env(),
        capture_output=True,
        check=True,
    )
    ours = {name for name in loaded if name.split(".")[0] in ("runner", "sandboxes")}
    others = {name.split(".")[0] for name in set(loaded) - set(json.loads(bare.stdout))} - {
        "runner",
        "sandboxes",
    }
    assert others <= set(sys.stdlib_module_names), others - set(sys.stdlib_module_names)
    assert ours <= {
        "runner",
        "runner.entry",
        "runner.entry.forward",
        "runner.config",
        "runner.config.locations",
        "runner.config.sockets",
        "sandboxes",
        "sandboxes.runtime_folder",
    }, ours
    assert served.finished("lean")["client"] == f"uid:{os.getuid()}"


def test_another_policy_than_the_servers_runs_the_call_directly(served: Served, tmp_path: Path) -> None:
    other = starter(tmp_path / "other")
    # The same tools by another policy file: the server would load the wrong one.
    env = served.env(RUNNER_POLICIES=str(other / "policies.yaml"))
    done = run_exec(served, *CASES["success"], "--request-id", "elsewhere", env=env)
    assert done.returncode == 0
    assert all(e.get("requestId") != "elsewhere" for e in served.audit())
    assert "client" not in [e for e in _events(other) if e.get("requestId") == "elsewhere"][-1]
    # A flag the fast path leaves to the full command line goes there too.
    flagged = run_exec(
        served, *CASES["success"], "--request-id", "flagged", "--policies", str(other / "policies.yaml")
    )
    assert flagged.returncode == 0
    assert any(e.get("requestId") == "flagged" for e in _events(other))


def test_a_stale_socket_runs_the_call_directly_and_at_once(served: Served, tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(stale))
    left.close()  # the file stays; nobody listens
    started = time.monotonic()
    done = run_exec(
        served, *CASES["success"], "--request-id", "stale", env=served.env(RUNNER_SOCKET=str(stale))
    )
    direct_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "client" not in served.finished("stale")
    assert direct_s < 60  # no wait on the dead socket (the direct call itself is the time)


def test_a_symlink_at_the_default_socket_is_never_followed(served: Served, tmp_path: Path) -> None:
    runtime = tmp_path / "xdg"
    (runtime / "runner").mkdir(parents=True, mode=0o700)
    runtime.chmod(0o700)
    (runtime / "runner" / "serve.sock").symlink_to(served.socket)
    env = {k: v for k, v in served.env(XDG_RUNTIME_DIR=str(runtime)).items() if k != "RUNNER_SOCKET"}
    done = run_exec(served, *CASES["success"], "--request-id", "via-link", env=env)
    assert done.returncode == 0, done.stderr
    assert "client" not in served.finished("via-link")


def _events(folder: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (folder / "audit.log").read_text().splitlines()]


def test_a_call_that_waits_for_approval_is_handed_back_to_runner_exec(served: Served) -> None:
    # The starter policy holds the admin's delete_file for a person's yes, which runner exec
    # asks on its own terminal: the server has nobody to ask, so the call runs directly
    # (here without a terminal: refused as approval_unavailable, by the direct path).
    argv = [
        "exec",
        "delete_file",
        "--role",
        "admin",
        "--params",
        '{"path": "x.txt"}',
        "--request-id",
        "needs-a-person",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "runner", *argv],
        cwd=served.folder,
        env=served.env(),
        capture_output=True,
        timeout=120,
        check=False,
        start_new_session=True,  # no controlling terminal
    )
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["error"]["details"]["reason"] == "approval_unavailable"
    finished = served.finished("needs-a-person")
    assert "client" not in finished, finished  # not through the socket (client uid:N)
