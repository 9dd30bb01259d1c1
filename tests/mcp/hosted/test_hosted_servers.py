"""Real third-party MCP servers, installed by ``runner mcp add`` (the session's ``installed``
fixture in conftest), called through the whole guard: ``mcp-server-time`` from
PyPI, and ``@modelcontextprotocol/server-filesystem`` from npm over a read-only workspace."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import assert_nothing_survives

from runner import Runner

pytestmark = [pytest.mark.registry, pytest.mark.slow]


@pytest.fixture(scope="module")
def hosted(installed: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    """A runner over both servers, everything granted, and ``ws``: the filesystem server
    over the policy's workspace (``workspace: read``, the server told ``/workspace``)."""
    root = tmp_path_factory.mktemp("hosted")
    tools = root / "tools"
    shutil.copytree(installed["project"] / "tools" / "time", tools / "time", symlinks=True)
    shutil.copytree(installed["project"] / "tools" / "files", tools / "ws", symlinks=True)
    manifest = yaml.safe_load((tools / "ws" / "tool.yaml").read_text())
    manifest.update(name="ws", workspace="read", command=[*manifest["command"][:2], "/workspace"])
    (tools / "ws" / "tool.yaml").write_text(yaml.safe_dump(manifest))
    (root / "workspace").mkdir()
    (root / "workspace" / "note.txt").write_text("hello from the workspace\n")
    policy = {
        "version": 1,
        "default_role": "user",
        "whitelist": ["*"],
        "roles": {"user": {"allow": ["*"]}},
        "workspace": "./workspace",
        "defaults": {"retries": 0},
    }
    (root / "policies.yaml").write_text(yaml.safe_dump(policy))
    with Runner.load(tools=tools, policies=root / "policies.yaml", audit_log=root / "audit.log") as runner:
        yield runner


def _error(answer: Any) -> dict[str, Any]:
    assert answer.error is not None, answer.result
    wire: dict[str, Any] = answer.error.to_wire()
    return wire


def test_time_is_listed_answers_and_an_invalid_timezone_is_a_tool_error(hosted: Runner) -> None:
    listed = {tool.name for tool in hosted.registry}
    assert {"time_get_current_time", "time_convert_time"} <= listed, hosted.registry.problems
    tool = hosted.registry.get("time_get_current_time")
    assert tool is not None and "mcp" in tool.manifest.tags
    answer = hosted.call("time_get_current_time", {"timezone": "Europe/Paris"}, request_id="time-ok")
    assert answer.success, answer.error
    assert "Europe/Paris" in str(answer.result)
    wrong = _error(hosted.call("time_get_current_time", {"timezone": "Mars/Olympus"}, request_id="time-bad"))
    assert (wrong["code"], wrong["details"]["reason"]) == ("EXECUTION_ERROR", "tool_error")
    assert "Mars/Olympus" in wrong["message"]
    for request_id in ("time-ok", "time-bad"):
        assert_nothing_survives(request_id)


def test_files_lists_and_reads_the_workspace(hosted: Runner) -> None:
    listing = hosted.call("ws_list_directory", {"path": "/workspace"})
    assert listing.success, listing.error
    assert "note.txt" in str(listing.result)
    read = hosted.call("ws_read_text_file", {"path": "/workspace/note.txt"})
    assert read.success, read.error
    assert "hello from the workspace" in str(read.result)


def test_a_path_outside_the_workspace_is_refused_by_the_server(hosted: Runner) -> None:
    refused = _error(hosted.call("ws_read_text_file", {"path": "/etc/passwd"}))
    assert (refused["code"], refused["details"]["reason"]) == ("EXECUTION_ERROR", "tool_error")
    assert "outside allowed directories" in refused["message"]


def test_a_write_is_refused_by_the_sandbox_the_workspace_being_read_only(hosted: Runner) -> None:
    written = _error(hosted.call("ws_write_file", {"path": "/workspace/new.txt", "content": "x"}))
    assert (written["code"], written["details"]["reason"]) == ("EXECUTION_ERROR", "tool_error")
    # The server allows the path; the kernel refuses the write.
    assert "read-only file system" in written["message"].lower() or "erofs" in written["message"].lower()
    assert hosted.policy.workspace is not None
    assert not (hosted.policy.workspace / "new.txt").exists()
