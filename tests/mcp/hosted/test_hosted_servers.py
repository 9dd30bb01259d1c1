"""Real third-party MCP servers, installed by ``runner mcp add`` (the session's ``installed``
fixture in conftest), called through the whole guard: ``mcp-server-time`` from
PyPI, and ``@modelcontextprotocol/server-filesystem`` from npm over a read-only workspace;
and ``@modelcontextprotocol/server-memory`` added with ``--session``, whose knowledge graph
lives as long as a session."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import assert_nothing_survives, new_project, runner_command

from runner import Runner
from sandboxes.testing import processes_with_env

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


MEMORY = "@modelcontextprotocol/server-memory"
ADA = {"name": "Ada", "entityType": "person", "observations": ["wrote the first program"]}


@pytest.fixture(scope="module")
def memory_project(registries: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project with the memory server added as the session docs show: its graph in the
    sandbox's /tmp, one server per session."""
    project = new_project(tmp_path_factory.mktemp("memory") / "project")
    added = runner_command(
        "mcp", "add", "memory", "--npm", MEMORY, "--session",
        "--env", "MEMORY_FILE_PATH=/tmp/memory.jsonl", "--grant", "user", "--json", cwd=project,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert "memory_create_entities" in {tool["name"] for tool in json.loads(added.stdout)["tools"]}
    return project


def test_the_memory_server_keeps_its_graph_for_a_session_and_no_further(memory_project: Path) -> None:
    manifest = yaml.safe_load((memory_project / "tools" / "memory" / "tool.yaml").read_text())
    assert manifest["session"] is True  # --session
    audit_log = memory_project / "audit.log"

    async def conversation() -> tuple[str, str]:
        policies = memory_project / "policies.yaml"
        async with (
            Runner.load(policies=policies, audit_log=audit_log, warm_pools=False) as runner,
            runner.session() as one,
            runner.session() as two,
        ):
            made = await one.acall("memory_create_entities", {"entities": [ADA]})
            assert made.success, made.error
            found = await one.acall("memory_open_nodes", {"names": ["Ada"]})  # a later call
            assert found.success, found.error
            assert found.result["entities"] == [ADA]
            other = await two.acall("memory_read_graph", {})
            assert other.success and other.result == {"entities": [], "relations": []}
            outside = await runner.acall("memory_read_graph", {})
            assert outside.success and outside.result == {"entities": [], "relations": []}
            again = await one.acall("memory_read_graph", {})
            assert again.success and [entity["name"] for entity in again.result["entities"]] == ["Ada"]
            return one.id, two.id

    first, second = asyncio.run(conversation())
    events = [json.loads(line) for line in audit_log.read_text().splitlines()]
    opened = [event for event in events if event["event"] == "session.opened"]
    assert sorted((event["sessionId"], event["toolName"]) for event in opened) == sorted(
        [(first, "memory"), (second, "memory")]
    )  # one server per session, started by its first call
    closed = [event for event in events if event["event"] == "session.closed"]
    assert sorted(event["calls"] for event in closed) == [1, 3] and {e["reason"] for e in closed} == {"ended"}
    finished = [event for event in events if event["event"] == "call.finished"]
    assert [event.get("sessionId") for event in finished] == [first, first, second, None, first]
    assert processes_with_env("MEMORY_FILE_PATH=/tmp/memory.jsonl") == []
