"""`runner client config`: each client's own file format and place, a merge that keeps what
is there (with a backup, replaced atomically), the token by variable only, a timeout
longer than the policy's largest deadline, and a stdio entry a real MCP client starts."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, runner_argv
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
SECRET = "tok-9f8e7d6c5b4a"


def configure(bench: ToolBench, *args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    bench.write_policy()
    home = home or bench.root / "home"
    env = {**os.environ, "HOME": str(home), "RUNNER_TOKEN": SECRET}
    env.pop("XDG_CONFIG_HOME", None)
    env.pop("CODEX_HOME", None)
    argv = runner_argv(bench, "client", "config", *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=bench.root, env=env)


@pytest.fixture
def tools(bench: ToolBench) -> ToolBench:
    bench.tool("echo", ECHO)
    return bench


PLACES = {
    "claude-desktop": ("home/.config/Claude/claude_desktop_config.json", ("mcpServers", "runner")),
    "claude-code": (".mcp.json", ("mcpServers", "runner")),
    "cursor": ("home/.cursor/mcp.json", ("mcpServers", "runner")),
    "vscode": (".vscode/mcp.json", ("servers", "runner")),
    "codex": ("home/.codex/config.toml", ("mcp_servers", "runner")),
}


def read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


def entry(document: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        document = document[key]
    return document


@pytest.mark.parametrize("client", list(PLACES))
def test_each_client_gets_its_own_format_in_its_own_file(tools: ToolBench, client: str) -> None:
    done = configure(tools, client, "--write")
    assert done.returncode == 0, done.stderr
    relative, keys = PLACES[client]
    server = entry(read(tools.root / relative), keys)
    assert Path(server["command"]).is_absolute()
    assert server["args"][-2:] == ["serve", "--stdio"]
    assert str((tools.root / "policies.yaml").resolve()) in server["args"]
    printed = configure(tools, client)  # without --write: the same entry, printed
    assert printed.returncode == 0
    first = printed.stdout if client != "claude-code" else printed.stdout.split("\n}\n")[0] + "\n}\n"
    assert entry(tomllib.loads(first) if client == "codex" else json.loads(first), keys) == server


@pytest.mark.parametrize("client", ["claude-code", "cursor", "vscode", "codex"])
def test_over_http_the_file_names_the_token_variable_and_never_holds_the_token(
    tools: ToolBench, client: str
) -> None:
    done = configure(
        tools, client, "--http", "http://127.0.0.1:8765", "--token-env", "RUNNER_TOKEN", "--write"
    )
    assert done.returncode == 0, done.stderr
    relative, keys = PLACES[client]
    text = (tools.root / relative).read_text()
    assert SECRET not in text and SECRET not in done.stdout + done.stderr
    server = entry(read(tools.root / relative), keys)
    assert server["url"] == "http://127.0.0.1:8765/mcp"  # serve --http's path added
    if client == "codex":
        assert server["bearer_token_env_var"] == "RUNNER_TOKEN"
    else:
        variable = "${RUNNER_TOKEN}" if client == "claude-code" else "${env:RUNNER_TOKEN}"
        assert server["headers"] == {"Authorization": f"Bearer {variable}"}


def test_a_write_keeps_the_other_servers_and_settings_and_backs_the_file_up(tools: ToolBench) -> None:
    path = tools.root / "home/.cursor/mcp.json"
    path.parent.mkdir(parents=True)
    before = {"mcpServers": {"other": {"command": "other-server"}}, "theme": "dark"}
    path.write_text(json.dumps(before))
    inode = path.stat().st_ino
    done = configure(tools, "cursor", "--write")
    assert done.returncode == 0, done.stderr
    after = read(path)
    assert after["mcpServers"]["other"] == {"command": "other-server"} and after["theme"] == "dark"
    assert "runner" in after["mcpServers"]
    backups = list(path.parent.glob("mcp.json.*.bak"))
    assert len(backups) == 1 and json.loads(backups[0].read_text()) == before
    # Replaced by a rename (a new inode), no temporary file left behind.
    assert path.stat().st_ino != inode
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(["mcp.json", backups[0].name])
    again = configure(tools, "cursor", "--write")
    assert "already has it" in again.stderr
    assert len(list(path.parent.glob("mcp.json.*.bak"))) == 1


def test_codex_keeps_the_comments_and_tables_of_its_toml(tools: ToolBench) -> None:
    path = tools.root / "home/.codex/config.toml"
    path.parent.mkdir(parents=True)
    path.write_text('# mine\nmodel = "o3"  # the model\n\n[mcp_servers.other]\ncommand = "x"\n')
    assert configure(tools, "codex", "--write").returncode == 0
    text = path.read_text()
    assert text.startswith('# mine\nmodel = "o3"  # the model\n\n[mcp_servers.other]\ncommand = "x"\n')
    assert set(tomllib.loads(text)["mcp_servers"]) == {"other", "runner"}


def test_a_file_that_is_not_plain_json_is_left_alone_with_a_one_line_error(tools: ToolBench) -> None:
    path = tools.root / ".vscode/mcp.json"
    path.parent.mkdir(parents=True)
    commented = '{\n  // my servers\n  "servers": {}\n}\n'
    path.write_text(commented)
    done = configure(tools, "vscode", "--write")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "not plain JSON" in done.stderr
    assert path.read_text() == commented and list(path.parent.glob("*.bak")) == []


def test_a_symlinked_config_file_keeps_its_link_and_its_target_is_updated(tools: ToolBench) -> None:
    target = tools.root / "dotfiles/mcp.json"
    target.parent.mkdir()
    target.write_text('{"mcpServers": {}}')
    link = tools.root / "home/.cursor/mcp.json"
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    assert configure(tools, "cursor", "--write").returncode == 0
    assert link.is_symlink() and "runner" in read(target)["mcpServers"]


def test_the_timeout_written_is_longer_than_the_policys_largest_deadline(tools: ToolBench) -> None:
    tools.tool("slow", ECHO)
    tools.policy["tools"] = {"slow": {"deadline_ms": 45_000}}
    assert configure(tools, "codex", "--write").returncode == 0
    server = read(tools.root / "home/.codex/config.toml")["mcp_servers"]["runner"]
    assert server["tool_timeout_sec"] > 45 and server["startup_timeout_sec"] >= 30
    settings = tools.root / ".claude/settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"env": {"MCP_TOOL_TIMEOUT": "1000", "OTHER": "1"}, "model": "x"}))
    assert configure(tools, "claude-code", "--write").returncode == 0
    written = read(settings)
    assert int(written["env"]["MCP_TOOL_TIMEOUT"]) > 45_000 and written["env"]["OTHER"] == "1"
    settings.write_text(json.dumps({"env": {"MCP_TOOL_TIMEOUT": "900000"}}))  # already longer: kept
    assert configure(tools, "claude-code", "--write").returncode == 0
    assert read(settings)["env"]["MCP_TOOL_TIMEOUT"] == "900000"
    tools.policy["tools"] = {"slow": {"deadline_ms": 120_000}}
    desktop = configure(tools, "claude-desktop")
    assert "Claude Desktop ends a tool call after 60 s" in desktop.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--http", "http://127.0.0.1:1"),
        ("--token-env", "T"),
        ("--http", "ftp://x", "--token-env", "T"),
        ("--http", "http://x", "--token-env", "NOT A NAME"),
        ("--http", "http://x", "--token-env", "T", "--role", "user"),
    ],
)
def test_an_incomplete_or_bad_http_set_up_is_a_one_line_usage_error(
    tools: ToolBench, args: tuple[str, ...]
) -> None:
    done = configure(tools, "codex", *args)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_stdio_entry_starts_a_server_the_mcp_sdk_calls_from_another_folder(
    tools: ToolBench, tmp_path: Path
) -> None:
    done = configure(tools, "claude-desktop", "--role", "user")
    assert done.returncode == 0, done.stderr
    server = json.loads(done.stdout)["mcpServers"]["runner"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    params = StdioServerParameters(
        command=server["command"], args=server["args"], cwd=str(elsewhere),
        env={"PYTHONPATH": os.environ["PYTHONPATH"]},
    )  # fmt: skip
    with (tmp_path / "stderr.txt").open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog)) as client:
            result = await client.call_tool("echo", {"x": 1})
    assert not result.is_error
