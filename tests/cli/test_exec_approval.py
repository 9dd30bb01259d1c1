"""``runner exec`` asks for approval on its terminal: a real ``runner exec`` process whose
controlling terminal is a pty the test types into, its answer piped as a script would."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import subprocess
import sys
import termios
import time
from typing import Any

import pytest
import yaml
from conftest import ToolBench, starter_dir

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
SECRET_PARAMS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "token": {"type": "string", "x-sensitive": True}},
}
PROMPT_END = b"[y/N] "


@pytest.fixture
def held(bench: ToolBench) -> ToolBench:
    bench.tool("wipe", ECHO, tags=["destructive"], parameters=SECRET_PARAMS)
    bench.policy["approval"] = {"tools": ["wipe"], "timeout_ms": 10000}
    return bench


def exec_argv(bench: ToolBench, params: dict[str, Any]) -> list[str]:
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))
    location = ["--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")]
    return [
        *[sys.executable, "-m", "runner", *location, "--audit-log", str(bench.audit_log)],
        *["exec", "wipe", "--params", json.dumps(params)],
    ]


def take_controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # stdin is the pty: it becomes /dev/tty


def on_terminal(
    bench: ToolBench, params: dict[str, Any], typed: bytes | None, ahead: bytes = b""
) -> tuple[int, dict[str, Any], str]:
    """Run ``runner exec wipe`` with a pty as its terminal; type ``ahead`` at once and
    ``typed`` once it asks (None: never answer). The exit status, the answer (its stdout,
    a pipe) and what the terminal showed."""
    master, slave = pty.openpty()
    with subprocess.Popen(
        exec_argv(bench, params),
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=take_controlling_terminal,  # noqa: PLW1509 - an ioctl only
    ) as process:
        os.close(slave)
        os.write(master, ahead)
        shown = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                continue
            try:
                shown += os.read(master, 65536)
            except OSError:
                break
            if typed is not None and shown.endswith(PROMPT_END):
                os.write(master, typed)
        stdout, _ = process.communicate(timeout=60)
    os.close(master)
    answer = json.loads(stdout) if stdout else {}
    return process.returncode, answer, shown.decode("utf-8", errors="replace")


def approvals(bench: ToolBench) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [e for e in events if e["event"] == "call.approval"]


def test_a_yes_on_the_terminal_runs_the_call_and_the_prompt_hides_sensitive_params(held: ToolBench) -> None:
    status, answer, shown = on_terminal(held, {"path": "/data", "token": "hunter2-secret"}, b"y\n")
    assert status == 0 and answer["result"] == {"path": "/data", "token": "hunter2-secret"}
    assert "wipe" in shown and "/data" in shown and "***" in shown
    assert "hunter2-secret" not in shown
    [approval] = approvals(held)
    assert approval["decision"] == "approved" and approval["by"] == "terminal"


@pytest.mark.parametrize("typed", [b"n\n", b"\n", b"maybe\n", b"\x04"])
def test_anything_but_yes_is_not_approved(held: ToolBench, typed: bytes) -> None:
    status, answer, _ = on_terminal(held, {"path": "/data"}, typed)
    assert status == 1
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert answer["error"]["details"]["reason"] == "not_approved"
    assert [e["decision"] for e in approvals(held)] == ["declined"]


def test_a_yes_typed_before_the_question_is_not_its_answer(held: ToolBench) -> None:
    held.policy["approval"]["timeout_ms"] = 1500
    status, answer, _ = on_terminal(held, {"path": "/data"}, None, ahead=b"y\n")
    assert status == 1 and answer["error"]["details"]["reason"] == "not_approved", answer
    assert [e["decision"] for e in approvals(held)] == ["timeout"]


def test_no_answer_within_timeout_ms_is_not_approved(held: ToolBench) -> None:
    held.policy["approval"]["timeout_ms"] = 500
    status, answer, _ = on_terminal(held, {"path": "/data"}, None)
    assert status == 1 and answer["error"]["details"]["reason"] == "not_approved"
    assert [e["decision"] for e in approvals(held)] == ["timeout"]


def test_ctrl_c_at_the_prompt_ends_the_call_unrun_with_status_130(held: ToolBench) -> None:
    status, answer, _ = on_terminal(held, {"path": "/data"}, b"\x03")
    assert status == 130 and answer == {}
    events = [json.loads(line)["event"] for line in held.audit_log.read_text().splitlines()]
    assert "call.attempt" not in events and events[-1] == "call.finished"


def test_escape_sequences_in_params_reach_the_terminal_escaped(held: ToolBench) -> None:
    hostile = "\x1b]0;pwned\x07\x1b[2J\u009b31m\u202e"
    status, _, shown = on_terminal(held, {"path": hostile}, b"n\n")
    assert status == 1
    assert not any(c in shown for c in "\x1b\x07\u009b\u202e")
    assert "\\u001b" in shown or "\\u001B" in shown


def test_without_a_terminal_the_call_is_approval_unavailable(held: ToolBench) -> None:
    done = subprocess.run(
        exec_argv(held, {"path": "/data"}),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        start_new_session=True,  # no controlling terminal: /dev/tty cannot be opened
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "PERMISSION_DENIED" and error["details"]["reason"] == "approval_unavailable"
    [approval] = approvals(held)
    assert approval["decision"] == "unavailable" and approval["by"] == "terminal"


def starter(*args: str) -> subprocess.CompletedProcess[str]:
    """A runner command over the set ``runner init`` writes, with no terminal to ask on."""
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env={**os.environ, "RUNNER_AUDIT_LOG": os.devnull},
        cwd=starter_dir(),
        start_new_session=True,
        timeout=60,
        check=False,
    )


def test_the_starter_set_holds_its_destructive_tool_for_approval_and_show_and_validate_say_so() -> None:
    sheet = json.loads(starter("show", "delete_file", "--json").stdout)
    assert "destructive" in sheet["metadata"]["tags"]
    assert sheet["approval"] == {"roles": ["admin"], "timeoutMs": 120000}
    assert json.loads(starter("show", "read_file", "--json").stdout)["approval"] is None
    report = json.loads(starter("validate", "--json").stdout)
    held = {tool["name"]: tool["approval"] for tool in report["tools"]}
    assert held["delete_file"] == ["admin"] and held["read_file"] == []
    assert not [p for p in report["problems"] if "approval" in p["reason"]]
    lines = starter("validate").stdout.splitlines()
    [line] = [line for line in lines if line.startswith("ok: delete_file ")]
    assert line.endswith("approval for admin")


def test_the_starter_admin_deleting_a_file_without_a_terminal_is_approval_unavailable() -> None:
    done = starter("exec", "delete_file", "--role", "admin", "--params", '{"path": "kept.txt"}')
    assert done.returncode == 1
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "PERMISSION_DENIED" and error["details"]["reason"] == "approval_unavailable"


def test_validate_warns_about_an_approval_rule_that_matches_no_tool(held: ToolBench) -> None:
    held.policy["approval"]["tools"] = ["wipe", "tag:nothing"]
    (held.root / "policies.yaml").write_text(yaml.safe_dump(held.policy))
    location = ["--tools", str(held.tools), "--policies", str(held.root / "policies.yaml")]
    report = json.loads(starter(*location, "validate", "--json").stdout)
    reasons = [p["reason"] for p in report["problems"]]
    assert "approval.tools: rule 'tag:nothing' matches no tool" in reasons
    assert {tool["name"]: tool["approval"] for tool in report["tools"]} == {"wipe": ["user"]}
