"""The command line, run as a real process: answers, exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import starter_dir

RUNNER = [sys.executable, "-m", "runner"]


def run(
    *args: str,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "RUNNER_AUDIT_LOG": os.devnull, **(env or {})}
    return subprocess.run(
        [*RUNNER, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or starter_dir(),
        timeout=60,
        preexec_fn=preexec_fn,
    )


def test_exec_prints_a_success_answer_and_exits_zero() -> None:
    started = time.monotonic()
    done = run("exec", "add_numbers", "--params", '{"a": 1, "b": 2}')
    assert time.monotonic() - started < 5.0
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["success"] is True
    assert answer["result"] == 3


def test_exec_of_a_failing_call_exits_one_with_the_answer_on_stdout() -> None:
    done = run("exec", "add_numbers", "--params", '{"a": "x"}')
    assert done.returncode == 1
    assert json.loads(done.stdout)["error"]["code"] == "INVALID_PARAMS"


def test_exec_reads_a_whole_request_or_discovery_from_stdin() -> None:
    request = {"tool_name": "echo", "params": {"message": "hi"}, "request_id": "req_stdin"}
    done = run("exec", "-", stdin=json.dumps(request))
    answer = json.loads(done.stdout)
    assert answer["result"]["message"] == "hi"
    assert answer["metadata"]["requestId"] == "req_stdin"
    discovery = json.loads(
        run("exec", "-", stdin='{"action": "discover", "options": {"filter": "math"}}').stdout
    )
    assert [t["name"] for t in discovery["result"]["tools"]] == ["add_numbers"]


def test_params_can_come_from_a_file(tmp_path: Path) -> None:
    params = tmp_path / "p.json"
    params.write_text('{"a": 40, "b": 2}')
    assert json.loads(run("exec", "add_numbers", "--params", f"@{params}").stdout)["result"] == 42


def test_params_from_a_closed_stdin_an_endless_file_or_bad_bytes_are_usage_errors(tmp_path: Path) -> None:
    # A closed stdin was a traceback; @/dev/zero read until the memory ran out; bad bytes
    # on stdin were INVALID_PARAMS (exit 1) where the same in a file were a usage error.
    def closed(*args: str) -> subprocess.CompletedProcess[str]:
        return run(*args, preexec_fn=lambda: os.close(0))

    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"a": 1, "b": "\xff"}')
    cases = {
        "closed stdin, params": closed("exec", "add_numbers", "--params", "@-"),
        "closed stdin, request": closed("exec", "-"),
        "endless file": run("exec", "add_numbers", "--params", "@/dev/zero"),
        "bad bytes in a file": run("exec", "add_numbers", "--params", f"@{bad}"),
    }
    for case, done in cases.items():
        assert done.returncode == 2, (case, done.stdout, done.stderr)
        assert done.stderr.startswith("runner: ") and "Traceback" not in done.stderr, (case, done.stderr)
    on_stdin = subprocess.run(
        [*RUNNER, "exec", "add_numbers", "--params", "@-"],
        input=bad.read_bytes(),
        capture_output=True,
        env={**os.environ, "RUNNER_AUDIT_LOG": os.devnull},
        cwd=starter_dir(),
        timeout=60,
    )
    assert on_stdin.returncode == 2, on_stdin
    assert b"not UTF-8 text (byte 15)" in on_stdin.stderr


def test_params_in_a_file_are_bounded_as_json_not_as_its_spaces(tmp_path: Path) -> None:
    # 10 MB of indentation around small params: the fast path through `runner serve
    # --socket` took them, the direct path refused the file's size.
    padded = tmp_path / "padded.json"
    padded.write_text('{"message": "hi"' + " " * 10_000_000 + "}")
    done = run("exec", "echo", "--params", f"@{padded}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"]["message"] == "hi"


def test_init_and_new_under_a_umask_of_077_make_tools_the_sandbox_can_read(tmp_path: Path) -> None:
    # Their folders were 0700: bubblewrap could not enter them as the sandbox's user.
    def private(*args: str) -> subprocess.CompletedProcess[str]:
        return run(*args, cwd=tmp_path, preexec_fn=lambda: os.umask(0o077))

    assert private("init").returncode == 0
    assert private("new", "mine").returncode == 0, "runner new"
    for folder in (tmp_path / "tools" / "add_numbers", tmp_path / "tools" / "mine"):
        assert folder.stat().st_mode & 0o777 == 0o755, folder
    done = private("exec", "add_numbers", "--params", '{"a": 1, "b": 2}')
    assert json.loads(done.stdout)["result"] == 3, (done.stdout, done.stderr)


def test_exec_options_reach_the_call() -> None:
    done = run(
        "exec",
        "echo",
        "--params",
        '{"message": "m"}',
        "--format",
        "raw",
        "--request-id",
        "req_opt",
        "--step-id",
        "s1",
        "--timeout",
        "3000",
        "--retries",
        "0",
    )
    answer = json.loads(done.stdout)
    assert answer["result"] == '{"message": "m", "attempt": 1}'
    assert answer["metadata"]["requestId"] == "req_opt"


def test_misuse_exits_two_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    cases = [
        run("exec", "add_numbers", "--no-such-flag"),
        run("exec", "add_numbers", "--params", "{not json"),
        run("exec", "add_numbers", "--params", "@/nonexistent/file.json"),
        run("--policies", str(tmp_path / "missing.yaml"), "exec", "add_numbers"),
        run("exec", "-", stdin="garbage"),
        run("list", "--role", "ghost"),
    ]
    for done in cases:
        assert done.returncode == 2, (done.args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_broken_policy_file_is_named_in_the_message(tmp_path: Path) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text("version: 1\nroles: [\n")
    done = run("--policies", str(policy), "list")
    assert done.returncode == 2
    assert str(policy) in done.stderr


def test_list_shows_what_the_role_may_call() -> None:
    user = json.loads(run("list", "--json").stdout)
    admin = json.loads(run("list", "--json", "--role", "admin").stdout)
    assert "write_file" not in {t["name"] for t in user["tools"]}
    assert "write_file" in {t["name"] for t in admin["tools"]}
    table = run("list", "--filter", "weather")
    assert table.returncode == 0
    assert table.stdout.startswith("get_weather")


def test_validate_reports_every_bad_manifest_and_lists_the_good(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tool.yaml").write_text("name: broken\n")
    done = run("validate", env={"RUNNER_TOOLS": f"{starter_dir() / 'tools'}:{tmp_path}"})
    assert done.returncode == 1
    assert f"invalid: {tmp_path / 'broken' / 'tool.yaml'}" in done.stdout
    assert "ok: add_numbers" in done.stdout
    assert run("validate").returncode == 0


def test_hostile_cli_input_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    latin1 = tmp_path / "params.json"
    latin1.write_bytes(b'{"a": "\xff"}')
    cases = [
        run("exec", "-", stdin="[" * 100_000),
        run("exec", "add_numbers", "--params", "[" * 100_000),
        run("exec", "add_numbers", "--params", f"@{latin1}"),
        run("audit", "--log", str(tmp_path)),
    ]
    for done in cases:
        assert done.returncode == 2, (done.args[:4], done.stderr[-300:])
        assert "Traceback" not in done.stderr
    answer = run("exec", "-", stdin='{"toolName": "echo", "params": {"message": "\\ud800"}}')
    assert "Traceback" not in answer.stderr
    assert json.loads(answer.stdout)["error"]["code"] == "INVALID_PARAMS"


def test_list_warns_on_stderr_about_manifests_left_out_and_exec_says_why_a_tool_is_missing(
    tmp_path: Path,
) -> None:
    from runner.config.starter import write_starter

    write_starter(tmp_path)
    broken = tmp_path / "tools" / "broken"
    broken.mkdir()
    (broken / "tool.yaml").write_text("name: broken\ncolor: blue\n")
    listed = run("list", "--json", cwd=tmp_path)
    assert listed.returncode == 0
    assert "broken" not in {t["name"] for t in json.loads(listed.stdout)["tools"]}  # stdout stays JSON
    assert "warning" in listed.stderr and "broken" in listed.stderr
    done = run("exec", "broken", cwd=tmp_path)
    answer = json.loads(done.stdout)
    assert done.returncode == 1
    assert answer["error"]["code"] == "TOOL_NOT_FOUND"
    assert answer["error"]["details"]["reason"] == "invalid_manifest"
    missing = json.loads(run("exec", "nothing_here", cwd=tmp_path).stdout)
    assert "reason" not in missing["error"]["details"]
