"""Runner faults are visible: ``internal`` for the caller, the traceback for the operator.

A bug (an exception nobody mapped) answers ``EXECUTION_ERROR`` reason ``internal``, not
retryable, with the exception's type name only; its traceback goes to the operator log
(``audit.operator_log``, relative to the policy file, or standard error). The docker
backend maps only the daemon's known failures to ``sandbox_unavailable``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from conftest import ToolBench
from docker import APIClient
from docker.errors import APIError

from runner.errors import ConfigError
from sandboxes import LaunchSpec, Limits, SandboxOutcome
from sandboxes.docker._client import shared_client

SECRET_PARAMS = {
    "type": "object",
    "properties": {"password": {"type": "string", "x-sensitive": True}},
}
PASSWORD = "hunter2-SECRET"
OPERATOR_LOG = "ops/operator.log"  # relative to the policy file
ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"


@dataclass
class BuggyBackend:
    """A backend whose ``run`` fails with an exception no one expects, quoting its input."""

    name: str = "buggy"
    closed: int = 0
    runs: list[bytes] = field(default_factory=list)

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> BuggyPrepared:
        return BuggyPrepared(self)


@dataclass
class BuggyPrepared:
    owner: BuggyBackend

    async def run(self, payload: bytes) -> SandboxOutcome:
        self.owner.runs.append(payload)
        raise ZeroDivisionError(f"bug while reading {payload.decode()}")

    async def close(self) -> None:
        self.owner.closed += 1


def assert_internal(answer: dict[str, object]) -> None:
    error = answer["error"]
    assert isinstance(error, dict)
    assert error["code"] == "EXECUTION_ERROR"
    assert error["details"] == {"reason": "internal"}
    assert error["retryable"] is False
    assert error["message"] == "internal error in the runner: ZeroDivisionError"
    text = json.dumps(answer)
    assert "Traceback" not in text
    assert "bug while reading" not in text
    assert PASSWORD not in text


def test_a_runner_fault_answers_internal_and_its_traceback_goes_to_the_operator_log(
    bench: ToolBench, capsys: pytest.CaptureFixture[str]
) -> None:
    bench.policy["audit"] = {"operator_log": OPERATOR_LOG}
    bench.tool("t", "", parameters=SECRET_PARAMS)
    backend = BuggyBackend()
    runner = bench.runner(sandbox_factory=lambda name: backend)
    answer = runner.handle({"toolName": "t", "params": {"password": PASSWORD}, "requestId": "req_bug"})
    assert_internal(answer)
    assert len(backend.runs) == 1
    assert backend.closed == 1
    log = (bench.root / OPERATOR_LOG).read_text()
    assert "Traceback (most recent call last)" in log
    assert "ZeroDivisionError: bug while reading" in log
    assert "req_bug" in log
    assert PASSWORD not in log  # the call's secrets are cut out of the traceback too
    assert "***" in log
    assert "Traceback" not in capsys.readouterr().err
    finished = json.loads(bench.audit_log.read_text().splitlines()[-1])
    assert (finished["event"], finished["code"], finished["reason"]) == (
        "call.finished",
        "EXECUTION_ERROR",
        "internal",
    )


def test_without_an_operator_log_the_traceback_goes_to_stderr(
    bench: ToolBench, capsys: pytest.CaptureFixture[str]
) -> None:
    bench.tool("t", "")
    runner = bench.runner(sandbox_factory=lambda name: BuggyBackend())
    assert_internal(runner.handle({"toolName": "t", "requestId": "req_bug"}))
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "ZeroDivisionError" in err
    assert "req_bug" in err


def test_runner_faults_never_open_the_breaker(bench: ToolBench) -> None:
    bench.policy["circuit_breaker"] = {"failure_threshold": 1, "reset_timeout_ms": 60000}
    bench.tool("t", "")
    backend = BuggyBackend()
    runner = bench.runner(sandbox_factory=lambda name: backend)
    for _ in range(3):
        assert_internal(runner.handle({"toolName": "t"}))
    assert len(backend.runs) == 3


def test_an_operator_log_that_cannot_be_opened_stops_the_runner(bench: ToolBench) -> None:
    bench.policy["audit"] = {"operator_log": "policies.yaml/operator.log"}  # under a file
    with pytest.raises(ConfigError, match="operator log"):
        bench.runner()


def docker_tool(bench: ToolBench, name: str) -> None:
    bench.tool(name, ECHO, sandbox="docker", image="runner/base:latest")


def slow_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make docker calls ask the daemon how the container ended, as for a daemon whose
    cgroups this host cannot see: the gate's trailer is then not enough."""
    from sandboxes.docker.sandbox import PreparedContainer

    async def unseen(self: object, attached: object) -> None:
        return None

    monkeypatch.setattr(PreparedContainer, "_settled", unseen)


def ours(client: APIClient, request_id: str) -> list[object]:
    found: list[object] = client.containers(all=True, filters={"label": f"io.runner.request-id={request_id}"})
    return found


@pytest.mark.docker
@pytest.mark.parametrize("method", ["start", "inspect_container"])
def test_a_docker_api_error_mid_call_is_sandbox_unavailable(
    bench: ToolBench, docker_client: APIClient, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    docker_tool(bench, "echo_d")
    runner = bench.runner()

    def refuse(*args: object, **kwargs: object) -> None:
        raise APIError("the daemon went away")

    slow_path(monkeypatch)
    monkeypatch.setattr(shared_client(), method, refuse)
    answer = runner.handle({"toolName": "echo_d", "params": {"x": 1}, "requestId": f"req_api_{method}"})
    monkeypatch.undo()
    runner.close()  # a dead container is removed off the call's path; close waits for it
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert ours(docker_client, f"req_api_{method}") == []


@pytest.mark.docker
def test_an_unexpected_exception_in_the_docker_backend_is_internal_and_the_container_goes(
    bench: ToolBench, docker_client: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench.policy["audit"] = {"operator_log": OPERATOR_LOG}
    docker_tool(bench, "echo_d")
    runner = bench.runner()

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("bug while reading the state")

    slow_path(monkeypatch)
    monkeypatch.setattr(shared_client(), "inspect_container", broken)
    answer = runner.handle({"toolName": "echo_d", "params": {"x": 1}, "requestId": "req_docker_bug"})
    monkeypatch.undo()
    runner.close()
    assert_internal(answer)
    log = (bench.root / OPERATOR_LOG).read_text()
    assert "Traceback (most recent call last)" in log
    assert "_final_state" in log
    assert "req_docker_bug" in log
    assert ours(docker_client, "req_docker_bug") == []
