"""A session sandbox whose workspace writes cannot all be applied when it closes: the
failure is told in ``session.closed`` (and to the operator), never raised into an
unrelated call nor out of the runner's close, which closes everything else all the same;
a cancellation stays a cancellation. Real sandboxes, the apply made to fail as a full
disk would (``_staging._copy_file``). Run as root and, by scripts/test-rootless.sh, as
an unprivileged user."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ToolBench
from support.mcp_harness import audit_events

from sandboxes import _staging, _workspace
from sandboxes.base import LaunchSpec, Limits
from sandboxes.subprocess import SubprocessSandbox
from sandboxes.testing import processes_with_env

WRITER = """
import json, os, sys
sys.stdin.read()
open(os.path.join(os.environ["WORKSPACE"], "written"), "w").write("x")
print(json.dumps({"pid": os.getpid()}))
"""


def _full(*_: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def mark(bench: ToolBench) -> str:
    value = uuid.uuid4().hex
    workspace = bench.root / "workspace"
    workspace.mkdir(exist_ok=True)
    bench.policy["workspace"] = str(workspace)
    bench.tool("writer", WRITER, workspace="write", session=True, env={"SESSION_MARK": value})
    return value


def test_the_runner_closes_every_session_and_its_audit_log_when_an_apply_fails(
    bench: ToolBench, mark: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_staging, "_copy_file", _full)

    audit_closed: list[bool] = []
    escaped: list[BaseException] = []

    async def scenario() -> tuple[str, ...]:
        runner = bench.runner()
        close_audit = runner.audit.close

        def closing() -> None:
            audit_closed.append(True)
            close_audit()

        monkeypatch.setattr(runner.audit, "close", closing)
        sessions = [runner.session() for _ in range(3)]
        for session in sessions:
            await session.__aenter__()
            answer = await session.acall("writer")
            assert answer.success, answer.error
        try:
            await runner.aclose()
        except Exception as exc:  # said below, after what it left undone
            escaped.append(exc)
        return tuple(session.id for session in sessions)

    ids = asyncio.run(scenario())
    closed = audit_events(bench, event="session.closed")
    assert sorted(event["sessionId"] for event in closed) == sorted(ids)
    for event in closed:
        assert event["reason"] == "runner_closed"
        assert "No space left on device" in event["workspaceNotApplied"], event
    assert processes_with_env(f"SESSION_MARK={mark}") == []
    assert audit_closed == [True]
    assert escaped == []  # no call to give it to: the audit and the operator were told


def test_the_next_call_is_not_given_the_failed_apply_of_the_sandbox_before_it(
    bench: ToolBench, mark: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_staging, "_copy_file", _full)

    async def scenario() -> None:
        async with bench.runner() as runner, runner.session() as session:
            first = await session.acall("writer")
            assert first.success, first.error
            policy_file = bench.root / "policies.yaml"
            policy_file.write_text(yaml.safe_dump(bench.policy))
            runner.reload([bench.tools], policy_file)  # the next call drops the sandbox first
            again = await session.acall("writer")
            assert again.success, again.error
            assert again.to_wire()["metadata"]["sessionRestarted"] is True

    asyncio.run(scenario())
    reloaded, ended = audit_events(bench, event="session.closed")
    assert reloaded["reason"] == "reloaded"
    assert "No space left on device" in reloaded["workspaceNotApplied"]
    assert ended["reason"] == "ended"
    assert processes_with_env(f"SESSION_MARK={mark}") == []


def test_a_cancelled_prepare_whose_close_fails_to_apply_still_raises_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Cancelled while its sandbox is made: what was made is closed, and its close fails
    # (the staged writes cannot be applied); the caller must see its cancellation.
    tool, workspace = tmp_path / "tool", tmp_path / "workspace"
    tool.mkdir()
    (tool / "main.py").write_text("print('{}')\n")
    opened = _workspace.GrantedWorkspace.open

    def slow_open(*args: Any, **kwargs: Any) -> _workspace.GrantedWorkspace | None:
        time.sleep(0.5)
        return opened(*args, **kwargs)

    def failing_apply(*_: Any) -> None:
        _full()

    monkeypatch.setattr(_workspace.GrantedWorkspace, "open", slow_open)
    monkeypatch.setattr(_staging.StagedWorkspace, "apply", failing_apply)
    monkeypatch.setattr(_staging.UserStagedWorkspace, "apply", failing_apply)
    spec = LaunchSpec("w", "", ("python3", "main.py"), tool, workspace=workspace, workspace_mode="write")
    backend = SubprocessSandbox()

    async def scenario() -> None:
        preparing = asyncio.ensure_future(backend.prepare(spec, Limits(timeout_ms=5000)))
        await asyncio.sleep(0.1)
        preparing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await preparing

    try:
        asyncio.run(scenario())
    finally:
        backend.preparers.shutdown()


def test_a_failed_apply_leaves_a_read_only_workspace_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without root the runner gives a 0555 folder u+rwx to apply into it: a failure
    # midway must give it back its mode. (Root needs no such opening up.)
    upper, workspace = tmp_path / "upper", tmp_path / "workspace"
    (upper / "sub").mkdir(parents=True)
    (upper / "sub" / "written").write_text("x")
    (workspace / "sub").mkdir(parents=True)
    (workspace / "sub").chmod(0o555)
    monkeypatch.setattr(_staging, "_copy_file", _full)
    source, dest = (os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in (upper, workspace))
    try:
        with pytest.raises(OSError, match="No space left"):
            _staging._apply_folder(source, dest, _staging._Budget(_staging.USER_OPAQUE_XATTR))
        assert stat.S_IMODE((workspace / "sub").stat().st_mode) == 0o555
    finally:
        os.close(source)
        os.close(dest)
        (workspace / "sub").chmod(0o755)


def test_a_sandbox_whose_session_closed_while_it_opened_is_closed_not_kept(bench: ToolBench) -> None:
    # An MCP session can end while one of its calls is still opening the tool's sandbox:
    # kept in the closed session, nothing would ever close it.
    from runner.call.policy import SessionModel
    from runner.call.sessions import CallSession
    from sandboxes import SandboxUnavailable

    closed: list[bool] = []

    class Opened:
        async def close(self) -> None:
            closed.append(True)

    async def scenario() -> None:
        runner = bench.runner()
        session = CallSession(runner._sessions, runner.audit, SessionModel, runner._clock)
        opening, opened = asyncio.Event(), asyncio.Event()

        async def open_() -> Opened:
            opening.set()
            await opened.wait()
            return Opened()

        backend = type("Backend", (), {"name": "fake"})()
        key = ("tool", "tool", "")
        taking = asyncio.ensure_future(session.take(key, backend, open_, None, 0))  # type: ignore[arg-type]
        await opening.wait()
        await session.aclose("ended")
        opened.set()
        with pytest.raises(SandboxUnavailable):
            await taking
        assert closed == [True]
        await runner.aclose()

    asyncio.run(scenario())
