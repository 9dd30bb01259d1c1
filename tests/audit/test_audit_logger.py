"""The audit trail owns its logger: a host's structlog set-up and an unwritable log.

The runner builds its logger with ``structlog.wrap_logger`` and never configures structlog,
so an application's own configuration, made before or after the runner loads, neither
changes the audit file nor is changed by it. An event that cannot be written is counted
and warned about once; under ``audit: {required: true}`` the call is refused instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from conftest import ToolBench
from structlog.testing import CapturingLoggerFactory
from structlog.typing import EventDict, WrappedLogger
from support.fakes import FakeSandbox, ManualClock, ok

from runner import Runner
from runner.audit.faults import OperatorLog
from runner.audit.log import AuditLog, MemorySink

REQUIRED = {"timestamp", "event", "requestId", "traceId", "toolName", "role"}
CALL_EVENTS = ["policy.decision", "call.attempt", "call.finished"]
FULL_DISK = Path("/dev/full")  # every write fails with ENOSPC


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def fake_runner(bench: ToolBench, audit_log: Path | None = None) -> tuple[Runner, FakeSandbox]:
    bench.tool("t", "")
    clock = ManualClock()
    sandbox = FakeSandbox(lambda n, _: ok(b'{"n": 1}'), clock)
    policy_path = bench.root / "policies.yaml"
    policy_path.write_text(yaml.safe_dump(bench.policy))
    runner = Runner.load(
        tools=bench.tools,
        policies=policy_path,
        audit_log=audit_log or bench.audit_log,
        clock=clock,
        sandbox_factory=lambda name: sandbox,
    )
    return runner, sandbox


def file_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def drop_everything(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    raise structlog.DropEvent


def configure_app(kind: str) -> CapturingLoggerFactory:
    """The host application's own structlog set-up: drop everything, or key=value lines."""
    factory = CapturingLoggerFactory()
    processors: list[Any] = (
        [drop_everything] if kind == "drops" else [structlog.processors.KeyValueRenderer(key_order=["event"])]
    )
    structlog.configure(
        processors=processors,
        logger_factory=factory,
        wrapper_class=structlog.make_filtering_bound_logger(0),
        cache_logger_on_first_use=True,
    )
    return factory


def test_loading_and_calling_leave_structlog_unconfigured(bench: ToolBench) -> None:
    before = structlog.get_config()
    runner, _ = fake_runner(bench)
    assert runner.handle({"toolName": "t"})["success"] is True
    assert structlog.is_configured() is False
    assert structlog.get_config() == before
    assert [e["event"] for e in file_events(bench.audit_log)] == CALL_EVENTS


@pytest.mark.parametrize("kind", ["drops", "renders"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_an_app_configuring_structlog_keeps_its_logging_and_the_audit_file_gets_every_event(
    bench: ToolBench, order: str, kind: str
) -> None:
    factory = configure_app(kind) if order == "before" else None
    runner, _ = fake_runner(bench)
    runner.handle({"toolName": "t", "requestId": "r1"})  # the runner's logger in use already
    if factory is None:
        factory = configure_app(kind)
    structlog.get_logger().info("app.started", port=8080)
    runner.handle({"toolName": "t", "requestId": "r2"})
    structlog.get_logger().info("app.stopped")

    events = file_events(bench.audit_log)
    assert [e["event"] for e in events] == CALL_EVENTS * 2
    assert [e["requestId"] for e in events] == ["r1"] * 3 + ["r2"] * 3
    assert all(set(e) >= REQUIRED for e in events)
    # The app's own logger works as it configured it, and sees none of the runner's events.
    lines = [call.args[0] for call in factory.logger.calls]
    if kind == "drops":
        assert lines == []
    else:
        assert lines == ["event='app.started' port=8080", "event='app.stopped'"]
    assert runner.audit.dropped == 0


def test_capture_logs_of_the_app_never_swallows_the_audit_trail(bench: ToolBench) -> None:
    runner, _ = fake_runner(bench)
    with structlog.testing.capture_logs() as app_logs:
        runner.handle({"toolName": "t"})
    assert app_logs == []
    assert [e["event"] for e in file_events(bench.audit_log)] == CALL_EVENTS


def test_an_unwritable_audit_log_counts_its_dropped_events_and_warns_once(
    bench: ToolBench, capsys: pytest.CaptureFixture[str]
) -> None:
    runner, sandbox = fake_runner(bench, FULL_DISK)
    first = runner.handle({"toolName": "t"})
    second = runner.handle({"toolName": "missing"})
    assert first["success"] is True  # not required: the call runs, its events are counted
    assert len(sandbox.runs) == 1
    assert second["error"]["code"] == "TOOL_NOT_FOUND"
    assert runner.audit.dropped == 3 + 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if "runner: warning" in line]
    assert len(warnings) == 1
    assert "audit" in warnings[0]
    assert "dropped" in warnings[0]


@pytest.mark.parametrize("audit_log", [FULL_DISK, None], ids=["full-disk", "writable"])
def test_a_required_audit_trail_that_cannot_be_written_refuses_the_call_before_it_runs(
    bench: ToolBench, audit_log: Path | None
) -> None:
    bench.policy["audit"] = {"required": True}
    runner, sandbox = fake_runner(bench, audit_log)
    answer = runner.handle({"toolName": "t"})
    if audit_log is None:  # the same call with a disk that works: it runs
        assert answer["success"] is True
        assert len(sandbox.runs) == 1
        return
    assert answer["success"] is False
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "audit_unavailable"
    assert answer["error"]["retryable"] is False
    assert answer["metadata"]["attempts"] == 0
    assert sandbox.runs == []  # the tool never ran
    assert runner.audit.dropped == 2  # the decision and call.finished


def test_a_required_audit_trail_refuses_even_calls_refused_for_another_reason(bench: ToolBench) -> None:
    bench.policy["audit"] = {"required": True}
    runner, _ = fake_runner(bench, FULL_DISK)
    answer = runner.handle({"toolName": "missing"})
    assert answer["error"]["details"]["reason"] == "audit_unavailable"


class BrokenSink(MemorySink):
    def write(self, line: str) -> None:
        raise RuntimeError("a bug in a sink")


def test_a_sink_that_fails_with_a_bug_is_counted_and_its_traceback_reaches_the_operator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    operator = OperatorLog.open(tmp_path / "operator.log")
    audit = AuditLog(sink=BrokenSink(), operator=operator)
    audit.emit("call.finished", requestId="r1")
    audit.emit("call.finished", requestId="r2")
    assert audit.dropped == 2
    text = (tmp_path / "operator.log").read_text()
    assert text.count("Traceback") == 1
    assert "RuntimeError: a bug in a sink" in text
    assert capsys.readouterr().err.count("runner: warning") == 1
    audit.close()


def test_the_policy_refuses_an_unknown_audit_setting(bench: ToolBench) -> None:
    from runner.errors import ConfigError

    bench.policy["audit"] = {"requierd": True}
    with pytest.raises(ConfigError, match="requierd"):
        bench.runner()
