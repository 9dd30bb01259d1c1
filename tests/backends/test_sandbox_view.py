"""What a tool sees from inside the subprocess sandbox: environment, folders, identity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ToolBench

from sandboxes.view import LIBRARY_MOUNT

REPORT = """
import json, os, sys
request = json.load(sys.stdin)
scratch = os.environ["TMPDIR"]
with open(os.path.join(scratch, "probe"), "w") as f:
    f.write("x")
json.dump({
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "uid": os.getuid(),
    "context": request["context"],
    "scratch_files": os.listdir(scratch),
}, sys.stdout)
"""


def test_the_tool_gets_exactly_the_minimal_environment_and_its_manifest_env(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_SECRET", "hunter2")
    bench.tool("report", REPORT, env={"GREETING": "hello"})
    answer = bench.runner().handle({"toolName": "report", "requestId": "req_env"})
    env = answer["result"]["env"]
    assert set(env) == {"PATH", "LANG", "HOME", "TMPDIR", "TOOL_NAME", "REQUEST_ID", "GREETING", "PYTHONPATH"}
    assert env["PYTHONPATH"] == LIBRARY_MOUNT  # where the tool-side helper is
    assert env["TOOL_NAME"] == "report"
    assert env["REQUEST_ID"] == "req_env"
    assert env["HOME"] == env["TMPDIR"]
    assert "hunter2" not in answer["result"].__repr__()


def test_the_payload_carries_params_and_the_attempt_context(bench: ToolBench) -> None:
    bench.tool("report", REPORT)
    answer = bench.runner().handle({"toolName": "report", "requestId": "req_ctx"})
    assert answer["result"]["context"] == {"requestId": "req_ctx", "toolName": "report", "attempt": 1}


def test_each_attempt_gets_a_fresh_scratch_directory(bench: ToolBench) -> None:
    bench.tool("report", REPORT)
    runner = bench.runner()
    first = runner.handle({"toolName": "report"})["result"]
    second = runner.handle({"toolName": "report"})["result"]
    assert first["scratch_files"] == ["probe"]
    assert second["scratch_files"] == ["probe"]  # nothing left over from the first call


def test_the_tool_runs_in_its_own_folder_as_an_unprivileged_user(bench: ToolBench) -> None:
    bench.tool("report", REPORT)
    result = bench.runner().handle({"toolName": "report"})["result"]
    assert result["cwd"] == "/tool"
    assert result["uid"] != 0
    if os.geteuid() == 0:
        assert result["uid"] == 65534


def test_the_workspace_is_mounted_only_when_granted_and_read_only_for_read(
    bench: ToolBench, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "note.txt").write_text("hello")
    bench.policy["workspace"] = str(workspace)
    probe = """
import json, os, sys
sys.stdin.read()
root = os.environ.get("WORKSPACE")
result = {"root": root}
if root:
    result["files"] = sorted(os.listdir(root))
    try:
        open(os.path.join(root, "new.txt"), "w").write("x")
        result["wrote"] = True
    except OSError:
        result["wrote"] = False
json.dump(result, sys.stdout)
"""
    bench.tool("none_ws", probe)
    bench.tool("read_ws", probe, workspace="read")
    bench.tool("write_ws", probe, workspace="write")
    runner = bench.runner()
    assert runner.handle({"toolName": "none_ws"})["result"] == {"root": None}
    read = runner.handle({"toolName": "read_ws"})["result"]
    assert read == {"root": "/workspace", "files": ["note.txt"], "wrote": False}
    write = runner.handle({"toolName": "write_ws"})["result"]
    assert write["wrote"] is True
    assert (workspace / "new.txt").read_text() == "x"
