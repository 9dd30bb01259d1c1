"""The EXECUTION_ERROR reasons, each for real: retried or not, counted by the breaker
or not, and ``retryable`` exactly for what a caller may sensibly try again.

Every reason is produced by a real tool in a real sandbox (only ``internal`` needs a
backend with a bug, as in test_faults), through the Python API and through
``python -m runner exec``. Attempts are counted twice: ``metadata.attempts`` and the
``call.attempt`` events of the audit log.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import ToolBench, answer_of

from runner.tools.tool_errors import MAX_DETAILS_BYTES, MAX_MESSAGE, NotAReport, ToolReport, read_report
from sandboxes import LaunchSpec, Limits, SandboxOutcome

RETRIES = 2  # so a retried failure makes 3 attempts and one that is not makes 1

READ = "import sys\nsys.stdin.read()\n"
# An executable that is no format the kernel runs (NUL bytes: not a script either).
NOT_A_PROGRAM = b"\x00\x01garbage\x00" * 32


def error_doc(**error: Any) -> str:
    return READ + f"import json\nprint(json.dumps({{'error': {error!r}}}))\nsys.exit(1)\n"


@dataclass(frozen=True)
class Case:
    id: str
    reason: str
    retried: bool
    counted: bool  # by the circuit breaker
    code: str = READ + "sys.exit(3)\n"
    manifest: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] = field(default_factory=dict)
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # name: (content, mode)


CASES = [
    Case("exit_code", "exit_code", retried=True, counted=True),
    # A tool that exits 127 itself, saying what a shell says when it cannot find a
    # program, even with a marker it made up: the tool ran, so it is a plain exit_code.
    Case(
        "exit_127_by_the_tool",
        "exit_code",
        retried=True,
        counted=True,
        code=READ
        + "sys.stderr.write('runner-exec: 1: exec: nope: not found\\n\\nrunner-exec-failed 00ff\\n')\n"
        + "sys.exit(127)\n",
    ),
    Case("signal", "signal", True, True, READ + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"),
    Case("tool_error", "tool_error", False, False, error_doc(message="no such city", code="NOT_FOUND")),
    Case(
        "tool_error_retryable",
        "tool_error",
        True,
        False,
        error_doc(message="upstream busy", code="BUSY", retryable=True),
    ),
    Case(
        "memory_limit",
        "memory_limit",
        False,
        True,
        READ + "hog = []\nwhile True:\n    hog.append(bytearray(8 * 1024 * 1024))\n",
        manifest={"limits": {"memory_mb": 64}},
    ),
    Case(
        "cpu_limit",
        "cpu_limit",
        False,
        True,
        READ + "while True:\n    pass\n",
        manifest={"limits": {"cpu_seconds": 1, "timeout_ms": 20000}},
    ),
    Case(
        "pids_limit",
        "pids_limit",
        False,
        True,
        READ
        + "import os, time\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        + "            time.sleep(30)\n            os._exit(0)\nexcept OSError:\n    sys.exit(1)\n",
        manifest={"limits": {"max_pids": 16}},
    ),
    Case(
        "output_limit",
        "output_limit",
        False,
        True,
        READ + "while True:\n    sys.stdout.write('y' * 65536)\n",
        manifest={"limits": {"max_output_bytes": 100000}},
    ),
    Case("program_not_found", "not_executable", False, True, manifest={"command": ["no-such-program-xyz"]}),
    Case("no_execute_right", "not_executable", False, True, manifest={"command": ["./main.py"]}),
    Case(
        "exec_format_error",
        "not_executable",
        False,
        True,
        manifest={"command": ["./blob"]},
        files={"blob": (NOT_A_PROGRAM, 0o755)},
    ),
    Case(
        "sandbox_unavailable",
        "sandbox_unavailable",
        False,
        False,
        policy={"sandbox": {"backends": {"subprocess": {"bwrap": "/nonexistent/bwrap"}}}},
    ),
]


def make(bench: ToolBench, case: Case, backend: str = "subprocess") -> None:
    manifest = dict(case.manifest)
    if backend == "docker":
        manifest.update(sandbox="docker", image="runner/base:latest")
    folder = bench.tool(case.id, case.code, **manifest)
    for name, (content, mode) in case.files.items():
        (folder / name).write_bytes(content)
        (folder / name).chmod(mode)
    bench.policy.update(case.policy)


def attempt_events(bench: ToolBench, request_id: str) -> int:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return sum(1 for e in events if e["event"] == "call.attempt" and e["requestId"] == request_id)


def assert_reason_rules(case: Case, answer: dict[str, Any]) -> None:
    """The answer of one call made with ``RETRIES`` retries, as docs/calls.md's table says."""
    error = answer["error"]
    assert answer["success"] is False
    if case.retried:
        assert answer["metadata"]["attempts"] == RETRIES + 1, answer
        assert error["code"] == "RETRY_EXHAUSTED", answer
        last = error["details"]["lastError"]
        assert last["code"] == "EXECUTION_ERROR"
        assert last["details"]["reason"] == case.reason, answer
        assert last["retryable"] is True
        assert error["retryable"] is True
    else:
        assert answer["metadata"]["attempts"] == 1, answer
        assert error["code"] == "EXECUTION_ERROR", answer
        assert error["details"]["reason"] == case.reason, answer
        assert error["retryable"] is False, answer


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_each_reason_is_retried_and_retryable_as_the_table_says(bench: ToolBench, case: Case) -> None:
    make(bench, case)
    runner = bench.runner()
    request_id = f"req_reason_{case.id}"
    answer = runner.handle(
        {
            "toolName": case.id,
            "requestId": request_id,
            "options": {"retries": RETRIES, "retryDelay": 0, "deadline": 60000, "timeout": 20000},
        }
    )
    assert_reason_rules(case, answer)
    expected_events = answer["metadata"]["attempts"] if case.reason != "sandbox_unavailable" else 1
    assert attempt_events(bench, request_id) == expected_events


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_breaker_counts_each_reason_as_the_table_says(bench: ToolBench, case: Case) -> None:
    bench.policy["circuit_breaker"] = {"failure_threshold": 2, "reset_timeout_ms": 60000}
    make(bench, case)
    runner = bench.runner()
    codes = []
    for _ in range(3):
        answer = runner.handle({"toolName": case.id, "options": {"retries": 0, "timeout": 20000}})
        codes.append(answer["error"]["code"])
    assert codes[:2] == ["EXECUTION_ERROR"] * 2, codes
    assert codes[2] == ("CIRCUIT_OPEN" if case.counted else "EXECUTION_ERROR"), codes


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_each_reason_through_the_command_line(bench: ToolBench, case: Case) -> None:
    make(bench, case)
    bench.write_policy()
    argv = [sys.executable, "-m", "runner", "exec", case.id, "--tools", str(bench.tools)]
    argv += ["--policies", str(bench.root / "policies.yaml"), "--audit-log", str(bench.audit_log)]
    argv += ["--retries", str(RETRIES), "--retry-delay", "0", "--deadline", "60000", "--timeout", "20000"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert_reason_rules(case, answer_of(done))
    assert "Traceback" not in done.stderr


# -- the internal reason: a runner fault, made by a backend with a bug ----------------


@dataclass
class BuggyBackend:
    name: str = "buggy"
    runs: int = 0

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> BuggyBackend:
        return self

    async def run(self, payload: bytes) -> SandboxOutcome:
        self.runs += 1
        raise ZeroDivisionError

    async def close(self) -> None:
        pass


def test_a_runner_fault_is_internal_not_retried_and_not_retryable(bench: ToolBench) -> None:
    bench.tool("t", READ)
    backend = BuggyBackend()
    runner = bench.runner(sandbox_factory=lambda name: backend)
    answer = runner.handle({"toolName": "t", "options": {"retries": RETRIES, "retryDelay": 0}})
    assert answer["error"]["details"]["reason"] == "internal"
    assert answer["error"]["retryable"] is False
    assert backend.runs == 1


# -- a tool-reported error, in detail ---------------------------------------------------


def test_a_tool_error_carries_the_tools_message_code_and_details(bench: ToolBench) -> None:
    bench.tool(
        "t", error_doc(message="no weather\nfor 'Atlantis'", code="NOT_FOUND", details={"city": "Atlantis"})
    )
    answer = bench.runner().handle({"toolName": "t", "options": {"retries": RETRIES, "retryDelay": 0}})
    error = answer["error"]
    assert error["code"] == "EXECUTION_ERROR"
    assert error["message"] == "no weather for 'Atlantis'"  # one line
    assert error["details"]["reason"] == "tool_error"
    assert error["details"]["toolCode"] == "NOT_FOUND"
    assert error["details"]["toolDetails"] == {"city": "Atlantis"}
    assert error["details"]["exitCode"] == 1
    assert error["retryable"] is False
    assert answer["metadata"]["attempts"] == 1


def test_a_retryable_tool_error_sees_its_attempt_grow(bench: ToolBench) -> None:
    bench.tool(
        "t",
        "import json, sys\nattempt = json.load(sys.stdin)['context']['attempt']\n"
        "if attempt < 3:\n"
        "    print(json.dumps({'error': {'message': 'busy', 'retryable': True}}))\n"
        "    sys.exit(1)\n"
        "print(json.dumps({'attempt': attempt}))\n",
    )
    answer = bench.runner().handle({"toolName": "t", "options": {"retries": RETRIES, "retryDelay": 0}})
    assert answer["success"] is True, answer
    assert answer["result"] == {"attempt": 3}


def test_an_error_document_with_exit_zero_is_a_success(bench: ToolBench) -> None:
    bench.tool("t", READ + 'print(\'{"error": {"message": "odd"}}\')\n')
    answer = bench.runner().handle({"toolName": "t"})
    assert answer["success"] is True
    assert answer["result"] == {"error": {"message": "odd"}}


def test_a_broken_error_document_is_a_plain_exit_code_saying_why(bench: ToolBench) -> None:
    bench.tool("t", error_doc(message="busy", retryable="yes"))
    answer = bench.runner().handle({"toolName": "t", "options": {"retries": RETRIES, "retryDelay": 0}})
    last = answer["error"]["details"]["lastError"]
    assert last["details"]["reason"] == "exit_code"
    assert last["details"]["errorDocument"] == "error.retryable must be a boolean"
    assert answer["metadata"]["attempts"] == RETRIES + 1


def test_the_shipped_get_weather_reports_an_unknown_city_as_a_tool_error(shipped: Any) -> None:
    answer = shipped.handle({"toolName": "get_weather", "params": {"city": "Atlantis"}})
    assert answer["error"]["details"]["reason"] == "tool_error"
    assert answer["metadata"]["attempts"] == 1


@pytest.mark.parametrize(
    ("stdout", "problem"),
    [
        ({"error": {"message": 3}}, "error.message must be a non-empty string"),
        ({"error": {"message": "  "}}, "error.message must be a non-empty string"),
        ({"error": {"message": "m", "code": 404}}, "error.code must be a string"),
        ({"error": {"message": "m", "code": "has space"}}, "error.code must be a string"),
        ({"error": {"message": "m", "retryable": 1}}, "error.retryable must be a boolean"),
        ({"error": {"message": "m", "details": [1]}}, "error.details must be an object"),
        ({"error": {"message": "m", "extra": 1}}, "error has unknown keys: extra"),
        ({"error": "just text"}, "error must be an object"),
        ({"error": {"message": "m"}, "result": 1}, "the error document has keys besides error"),
    ],
)
def test_an_error_document_of_the_wrong_shape_is_not_a_report(stdout: Any, problem: str) -> None:
    report = read_report(json.dumps(stdout).encode())
    assert isinstance(report, NotAReport)
    assert report.problem.startswith(problem)


@pytest.mark.parametrize("stdout", [b"", b"not json", b"[1]", b'{"result": 1}', b'{"error": NaN}'])
def test_output_that_is_no_error_document_is_no_report(stdout: bytes) -> None:
    assert read_report(stdout) is None


def test_a_report_is_bounded_and_printable() -> None:
    long_message = "\x1b[31mred\x07 " + "x" * 1000
    report = read_report(
        json.dumps({"error": {"message": long_message, "details": {"k\n": "a\tb\x00"}}}).encode()
    )
    assert isinstance(report, ToolReport)
    assert report.message.startswith("[31mred x")
    assert len(report.message) == MAX_MESSAGE + 3
    assert report.details == {"k ": "a b "}
    huge = read_report(
        json.dumps({"error": {"message": "m", "details": {"x": "y" * MAX_DETAILS_BYTES}}}).encode()
    )
    assert isinstance(huge, ToolReport)
    assert huge.details is None
    assert huge.details_omitted == f"larger than {MAX_DETAILS_BYTES} bytes"
    deep: Any = {}
    for _ in range(20):
        deep = {"d": deep}
    nested = read_report(json.dumps({"error": {"message": "m", "details": deep}}).encode())
    assert isinstance(nested, ToolReport)
    assert nested.details is None
    assert nested.details_omitted is not None


# -- not_executable is never taken on the tool's word ------------------------------------


def test_a_tool_cannot_forge_not_executable_through_its_environment(bench: ToolBench) -> None:
    """The guard's variable, set by the manifest, is neither kept nor a way to forge the proof."""
    bench.tool(
        "t",
        "import os, sys\nsys.stdin.read()\n"
        "sys.stderr.write('exec: x: not found\\n\\nrunner-exec-failed ' + os.environ.get('runner_exec_token', 'none') + '\\n')\n"
        "sys.exit(127)\n",
        env={"runner_exec_token": "chosen-by-the-manifest"},
    )
    answer = bench.runner().handle({"toolName": "t", "options": {"retries": 0}})
    assert answer["error"]["details"]["reason"] == "exit_code", answer
    assert "runner-exec-failed none" in answer["error"]["details"]["stderr"]


def test_the_tool_reads_exactly_its_payload_after_the_guard(bench: ToolBench) -> None:
    bench.tool(
        "t",
        "import json, os, sys\nprint(json.dumps({'stdin': sys.stdin.read(), 'env': sorted(os.environ)}))\n",
    )
    answer = bench.runner().handle({"toolName": "t", "params": {"a": 1}, "requestId": "req_x"})
    assert json.loads(answer["result"]["stdin"])["params"] == {"a": 1}
    assert "runner_exec_token" not in answer["result"]["env"]


def test_a_missing_program_says_which_and_why(bench: ToolBench) -> None:
    bench.tool("t", READ, command=["no-such-program-xyz", "arg"])
    error = bench.runner().handle({"toolName": "t"})["error"]
    assert error["message"] == "t could not be started: no-such-program-xyz: not found"
    assert error["details"]["exitCode"] == 127
    assert "runner-exec-failed" not in error["details"]["stderr"]


def test_a_missing_script_for_an_interpreter_is_the_interpreters_exit_code(bench: ToolBench) -> None:
    """The interpreter started: its complaint is its own exit status (documented choice)."""
    bench.tool("t", READ, command=["python3", "missing.py"])
    answer = bench.runner().handle({"toolName": "t", "options": {"retries": 0}})
    assert answer["error"]["details"]["reason"] == "exit_code"
    assert answer["error"]["details"]["exitCode"] == 2


# -- docker: the same reasons from the gate in the container ------------------------------

DOCKER_CASES = [
    case
    for case in CASES
    if case.id
    in {
        "exit_127_by_the_tool",
        "tool_error",
        "program_not_found",
        "no_execute_right",
        "exec_format_error",
    }
]


@pytest.mark.docker
@pytest.mark.parametrize("case", DOCKER_CASES, ids=lambda case: case.id)
def test_docker_tells_a_program_that_cannot_start_from_a_tool_that_exits_127(
    bench: ToolBench, case: Case, docker_client: Any
) -> None:
    make(bench, case, backend="docker")
    answer = bench.runner().handle(
        {"toolName": case.id, "options": {"retries": RETRIES, "retryDelay": 0, "deadline": 60000}}
    )
    assert_reason_rules(case, answer)


@pytest.mark.docker
def test_docker_says_which_program_is_missing(bench: ToolBench, docker_client: Any) -> None:
    bench.tool("t", READ, command=["no-such-program-xyz"], sandbox="docker", image="runner/base:latest")
    error = bench.runner().handle({"toolName": "t"})["error"]
    assert error["message"] == "t could not be started: no-such-program-xyz: not found"
    assert error["details"]["exitCode"] == 127


def test_the_cases_cover_the_whole_reason_table_with_its_rules() -> None:
    """secret_unavailable: tests/secrets/test_secrets.py; internal: above; audit_unavailable:
    tests/audit/test_audit_logger.py (refused before any attempt); node_lost:
    tests/dispatch/test_dispatch_ray.py (a Ray node killed under a dispatched call);
    workspace_not_applied: tests/hostile/test_rootless_workspace.py (run as a user)."""
    from runner.errors import REASON_RULES

    others = {"internal", "secret_unavailable", "audit_unavailable", "node_lost", "workspace_not_applied"}
    assert {case.reason for case in CASES} | others == set(REASON_RULES)
    for case in CASES:
        if case.reason != "tool_error":  # retried on the tool's word, not the table's
            assert REASON_RULES[case.reason].retried is case.retried, case.id


def test_the_attempt_event_names_the_tool_error(bench: ToolBench) -> None:
    bench.tool("t", error_doc(message="no such city"))
    bench.runner().handle({"toolName": "t", "requestId": "req_audit_te"})
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    attempts = [e for e in events if e["event"] == "call.attempt" and e["requestId"] == "req_audit_te"]
    assert [e["reason"] for e in attempts] == ["tool_error"]


def test_messages_mask_host_paths_but_keep_image_names() -> None:
    from runner.call.outcomes import mask_host_paths

    masked = mask_host_paths(
        'image runner/nope:latest not found; cannot read /etc/shadow or "/root/key" (/tmp/x)'
    )
    assert "runner/nope:latest" in masked
    assert "/etc" not in masked and "/root" not in masked and "/tmp" not in masked
