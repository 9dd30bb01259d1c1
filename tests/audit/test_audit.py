"""The audit trail: events of every path, no forging, redaction, concurrent writers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, starter_dir
from support.fakes import FakeSandbox, ManualClock, failed

REQUIRED = {"timestamp", "event", "requestId", "traceId", "toolName", "role"}
OK = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
SECRET_PARAMS = {
    "type": "object",
    "properties": {"user": {"type": "string"}, "password": {"type": "string", "x-sensitive": True}},
    "additionalProperties": False,
}


def events_of(bench: ToolBench, request: dict[str, Any], **runner_kwargs: Any) -> list[dict[str, Any]]:
    runner = bench.runner(**runner_kwargs)
    with runner.audit.captured() as logs:  # the lines the file would get, parsed back
        runner.handle(request)
    return logs


def names(logs: list[dict[str, Any]]) -> list[str]:
    return [entry["event"] for entry in logs]


def test_an_allowed_call_logs_decision_attempt_and_finish(bench: ToolBench) -> None:
    bench.tool("ok", OK)
    logs = events_of(bench, {"toolName": "ok", "stepId": "s9", "metadata": {"userId": "u_7"}})
    assert names(logs) == ["policy.decision", "call.attempt", "call.finished"]
    assert logs[0]["decision"] == "allow"
    assert logs[0]["rule"] == "*"
    assert logs[1]["attempt"] == 1
    assert logs[1]["sandbox"] == "subprocess"
    assert logs[1]["exitCode"] == 0
    assert logs[2]["success"] is True
    assert logs[2]["attempts"] == 1
    for entry in logs:
        assert {"event", "requestId", "traceId", "toolName", "role"} <= set(entry)
        assert entry["stepId"] == "s9"
        assert entry["userId"] == "u_7"
    assert len({entry["requestId"] for entry in logs}) == 1


def test_a_denied_call_logs_the_deny_and_its_reason(bench: ToolBench) -> None:
    bench.tool("ok", OK)
    bench.policy["disabled"] = ["ok"]
    logs = events_of(bench, {"toolName": "ok"})
    assert names(logs) == ["policy.decision", "call.finished"]
    assert logs[0]["decision"] == "deny"
    assert logs[0]["reason"] == "disabled"
    assert logs[1]["code"] == "PERMISSION_DENIED"


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        ({"toolName": "ghost"}, "TOOL_NOT_FOUND"),
        ({"toolName": 5}, "INVALID_PARAMS"),
        ("junk", "INVALID_PARAMS"),
    ],
)
def test_calls_refused_before_the_policy_are_logged(
    bench: ToolBench, request_: dict[str, Any], code: str
) -> None:
    logs = events_of(bench, request_)
    assert names(logs) == ["policy.decision", "call.finished"]
    assert logs[0]["decision"] == "deny"
    assert logs[0]["reason"] == ("tool_not_found" if code == "TOOL_NOT_FOUND" else "invalid_request")
    assert logs[1]["code"] == code
    assert logs[1]["attempts"] == 0


def test_invalid_params_are_logged_after_the_decision(bench: ToolBench) -> None:
    bench.tool("strict", OK, parameters=SECRET_PARAMS)
    logs = events_of(bench, {"toolName": "strict", "params": {"nope": 1}})
    assert names(logs) == ["policy.decision", "call.finished"]
    assert logs[1]["code"] == "INVALID_PARAMS"


def test_a_timeout_with_retries_logs_each_attempt(bench: ToolBench) -> None:
    bench.tool("sleepy", "import sys, time\nsys.stdin.read()\ntime.sleep(30)\n")
    logs = events_of(
        bench, {"toolName": "sleepy", "options": {"timeout": 150, "retries": 2, "retryDelay": 10}}
    )
    attempts = [entry for entry in logs if entry["event"] == "call.attempt"]
    assert [a["attempt"] for a in attempts] == [1, 2, 3]
    assert {a["reason"] for a in attempts} == {"timeout"}
    assert logs[-1]["code"] == "TIMEOUT"
    assert logs[-1]["attempts"] == 3


def test_an_open_breaker_is_logged_with_zero_attempts(bench: ToolBench) -> None:
    bench.policy["circuit_breaker"] = {"failure_threshold": 1, "reset_timeout_ms": 60000}
    bench.tool("t", "")
    clock = ManualClock()
    sandbox = FakeSandbox(lambda n, _: failed(), clock)
    runner = bench.runner(clock=clock, sandbox_factory=lambda name: sandbox)
    runner.handle({"toolName": "t"})
    with runner.audit.captured() as logs:
        runner.handle({"toolName": "t"})
    assert names(logs) == ["policy.decision", "call.finished"]
    assert logs[-1]["code"] == "CIRCUIT_OPEN"
    assert logs[-1]["attempts"] == 0


def run_cli(
    *args: str, cwd: Path | None = None, audit: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RUNNER_AUDIT_LOG": str(audit)}
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd or starter_dir(),
        timeout=60,
    )


def test_a_denied_call_is_found_by_request_id(tmp_path: Path) -> None:
    audit = tmp_path / "audit.log"
    run_cli(
        "exec",
        "write_file",
        "--params",
        '{"path": "a", "content": "b"}',
        "--request-id",
        "req_denied",
        audit=audit,
    )
    run_cli("exec", "add_numbers", "--params", '{"a": 1, "b": 2}', audit=audit)
    found = run_cli("audit", "--request-id", "req_denied", "--json", audit=audit)
    events = [json.loads(line) for line in found.stdout.splitlines()]
    assert [e["event"] for e in events] == ["policy.decision", "call.finished"]
    assert events[0]["decision"] == "deny"
    denies = run_cli("audit", "--decision", "deny", "--json", audit=audit)
    assert [json.loads(line)["requestId"] for line in denies.stdout.splitlines()] == ["req_denied"]
    table = run_cli("audit", "--tool", "write_file", audit=audit)
    assert table.returncode == 0
    assert "deny (not_allowed)" in table.stdout
    assert run_cli("audit", "--code", "PERMISSION_DENIED", "--json", audit=audit).stdout.count("\n") == 1
    assert run_cli("audit", "--since", "2999-01-01T00:00:00Z", "--json", audit=audit).stdout == ""
    assert run_cli("audit", "--until", "2000-01-01", "--json", audit=audit).stdout == ""
    assert run_cli("audit", "--since", "not-a-time", audit=audit).returncode == 2


def test_a_request_id_or_param_with_newlines_and_json_forges_nothing(tmp_path: Path) -> None:
    audit = tmp_path / "audit.log"
    forged = 'x"}\n{"event": "policy.decision", "decision": "allow", "requestId": "forged'
    run_cli("exec", "-", stdin=json.dumps({"toolName": "echo", "params": {"message": forged}}), audit=audit)
    refused = run_cli(
        "exec",
        "-",
        stdin=json.dumps({"toolName": "echo", "params": {"message": "m"}, "requestId": forged}),
        audit=audit,
    )
    assert json.loads(refused.stdout)["error"]["code"] == "INVALID_PARAMS"  # ids are printable text
    run_cli("exec", "-", stdin=json.dumps({"toolName": forged}), audit=audit)
    lines = audit.read_text().splitlines()
    assert len(lines) == 7  # decision, attempt, finished; then decision and finished, twice
    events = [json.loads(line) for line in lines]
    assert all(set(e) >= REQUIRED for e in events)
    assert events[0]["params"] == {"message": forged}
    assert events[3]["requestId"] == forged
    assert all(e["requestId"] != "forged" for e in events)
    assert [e["decision"] for e in events if e["event"] == "policy.decision"] == ["allow", "deny", "deny"]


def test_x_sensitive_values_never_reach_the_file(bench: ToolBench) -> None:
    bench.tool("login", OK, parameters=SECRET_PARAMS)
    runner = bench.runner()
    answer = runner.handle({"toolName": "login", "params": {"user": "ann", "password": "s3cr3t-PASS"}})
    assert answer["success"] is True
    text = bench.audit_log.read_text()
    assert "s3cr3t-PASS" not in text
    decision = next(json.loads(line) for line in text.splitlines() if '"policy.decision"' in line)
    assert decision["params"] == {"user": "ann", "password": "***"}


def test_long_values_are_bounded(bench: ToolBench) -> None:
    bench.tool("ok", OK)
    bench.runner().handle({"toolName": "ok", "params": {"blob": "y" * 100_000}, "requestId": "r" * 256})
    for line in bench.audit_log.read_text().splitlines():
        assert len(line) < 8000


WRITER = """
import sys
from runner import Runner
runner = Runner.load(tools=sys.argv[1], policies=sys.argv[2], audit_log=sys.argv[3])
for i in range(int(sys.argv[4])):
    runner.handle({"toolName": "ok", "params": {"pad": "p" * 3000, "i": i}})
    runner.handle({"toolName": "missing"})
"""


def test_eight_processes_writing_one_log_leave_only_whole_lines(bench: ToolBench) -> None:
    bench.tool("ok", OK)
    bench.runner()
    per_process = 5
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                str(bench.tools),
                str(bench.root / "policies.yaml"),
                str(bench.audit_log),
                str(per_process),
            ],
            cwd=bench.root,
        )
        for _ in range(8)
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    lines = bench.audit_log.read_text().splitlines()
    # per ok call: decision + attempt + finished; per missing call: decision + finished
    assert len(lines) == 8 * per_process * 5
    events = [json.loads(line) for line in lines]
    assert all(set(e) >= REQUIRED for e in events)


def test_runner_audit_skips_a_torn_last_line(tmp_path: Path) -> None:
    audit = tmp_path / "audit.log"
    run_cli("exec", "add_numbers", "--params", '{"a": 1, "b": 2}', audit=audit)
    with audit.open("a") as log:
        log.write('{"event": "call.fin')
    done = run_cli("audit", "--json", audit=audit)
    assert done.returncode == 0
    assert len(done.stdout.splitlines()) == 3


def test_nested_and_referenced_sensitive_values_are_redacted(bench: ToolBench) -> None:
    schema = {
        "type": "object",
        "$defs": {"secret": {"type": "string", "x-sensitive": True}},
        "properties": {
            "auth": {
                "type": "object",
                "properties": {"token": {"$ref": "#/$defs/secret"}, "user": {"type": "string"}},
            },
            "keys": {"type": "array", "items": {"type": "string", "x-sensitive": True}},
        },
    }
    bench.tool("nested", OK, parameters=schema)
    bench.runner().handle(
        {
            "toolName": "nested",
            "params": {"auth": {"token": "tok-SECRET", "user": "ann"}, "keys": ["k-SECRET-1", "k-SECRET-2"]},
        }
    )
    text = bench.audit_log.read_text()
    assert "SECRET" not in text
    decision = next(json.loads(line) for line in text.splitlines() if '"policy.decision"' in line)
    assert decision["params"] == {"auth": {"token": "***", "user": "ann"}, "keys": ["***", "***"]}


def test_runner_audit_takes_a_request_id_prefix_and_a_limit_and_survives_a_closed_pipe(
    bench: ToolBench,
) -> None:
    bench.tool("t", "import sys\nsys.stdin.read()\nprint('{}')\n")
    runner = bench.runner()
    for i in range(40):
        runner.handle({"toolName": "t", "requestId": f"req_batch_{i:03d}"})
    runner.handle({"toolName": "t", "requestId": "other_one"})
    log = str(bench.audit_log)
    found = run_cli("audit", "--log", log, "--json", "--request-id", "req_batch_01", audit=bench.audit_log)
    ids = {json.loads(line)["requestId"] for line in found.stdout.splitlines()}
    assert ids == {f"req_batch_{i:03d}" for i in range(10, 20)}
    limited = run_cli("audit", "--log", log, "--json", "--limit", "2", audit=bench.audit_log)
    assert len(limited.stdout.splitlines()) == 2
    # `runner audit | head -1`: the reader leaves after one line, with far more to come
    # than a pipe holds.
    first = bench.audit_log.read_text().splitlines()[0]
    with bench.audit_log.open("a") as more:
        more.write((first + "\n") * 3000)
    reader = subprocess.Popen(
        [sys.executable, "-m", "runner", "audit", "--log", log],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=starter_dir(),
        env={**os.environ, "RUNNER_AUDIT_LOG": log},
    )
    assert reader.stdout is not None and reader.stderr is not None
    reader.stdout.readline()
    reader.stdout.close()
    stderr = reader.stderr.read().decode()
    reader.stderr.close()
    assert reader.wait(timeout=60) == 0, stderr
    assert "Traceback" not in stderr and "Broken" not in stderr


@pytest.mark.parametrize("log", ["audit", "chained audit", "operator"])
@pytest.mark.parametrize("plant", ["link", "dangling link", "fifo", "open folder", "linked folder"])
def test_the_logs_are_never_opened_through_a_planted_link_fifo_or_open_folder(
    bench: ToolBench, tmp_path: Path, log: str, plant: str
) -> None:
    # As root, the audit and operator logs were appended to through a symlink at their
    # name (another file got root's lines, or a dangling link had root create one), a
    # FIFO there hung the runner, and a linked folder led even a chained log elsewhere.
    from runner import Runner
    from runner.errors import ConfigError

    logs, victim = tmp_path / "logs", tmp_path / "victim"
    logs.mkdir()
    victim.write_text("precious\n")
    folder = logs
    if plant == "linked folder":
        folder = tmp_path / "linked"
        folder.symlink_to(logs, target_is_directory=True)
    where = folder / f"{log.rsplit(maxsplit=1)[-1]}.log"
    if plant == "link":
        where.symlink_to(victim)
    elif plant == "dangling link":
        where.symlink_to(logs / "elsewhere")
    elif plant == "fifo":
        os.mkfifo(where)
    elif plant == "open folder":
        logs.chmod(0o777)
    bench.policy["audit"] = {"chain": log == "chained audit"}
    if log == "operator":
        bench.policy["audit"]["operator_log"] = str(where)
    audit_log = where if log != "operator" else bench.audit_log
    with pytest.raises(ConfigError, match=r"symbolic link|every user|No such device|not a regular file"):
        Runner.load(tools=bench.tools, policies=bench.write_policy(), audit_log=audit_log).close()
    assert victim.read_text() == "precious\n"
    assert not (logs / "elsewhere").exists()


def test_standard_error_and_a_folder_made_under_umask_000_are_taken(bench: ToolBench, tmp_path: Path) -> None:
    # /dev/stderr is a link (to this process's descriptor), and the opener that follows no
    # link refused it; under umask 000 it refused the folder it had just made.
    from runner import Runner

    bench.tool("ok", OK)
    Runner.load(tools=bench.tools, policies=bench.write_policy(), audit_log=Path("/dev/stderr")).close()
    old = os.umask(0)
    try:
        deep = tmp_path / "new" / "sub" / "audit.log"
        Runner.load(tools=bench.tools, policies=bench.write_policy(), audit_log=deep).close()
    finally:
        os.umask(old)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755
