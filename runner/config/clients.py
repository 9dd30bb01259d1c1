"""What each MCP client needs in its own configuration to reach the runner.

``client_config`` says, for one client, which files get which entry: the server entry
(``runner serve --stdio`` to start, or ``runner serve --http``'s URL with a bearer token
read from an environment variable: the file names the variable, never the token) and,
where the client has a setting for it, a request timeout longer than the policy's largest
deadline. ``runner.config.client_files`` prints or merges them.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CLIENTS = ("claude-desktop", "claude-code", "cursor", "vscode", "codex")
# The client's timeout is the largest deadline plus this: the runner's own TIMEOUT answer,
# sent at the deadline, must still reach the client.
MARGIN_S = 10
# Codex waits this long for a server to start (its default, 10 s, is short for a runner
# loading many tools on a busy host).
CODEX_STARTUP_S = 30
# Claude Desktop's tool calls end after 60 s (the MCP TypeScript SDK's default request
# timeout); its file has no setting for it.
CLAUDE_DESKTOP_LIMIT_S = 60
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ClientConfigError(ValueError):
    """The asked-for set-up cannot be made; the message says why and what to do."""


@dataclass(frozen=True)
class Reach:
    """How the client reaches the runner: a command to start (stdio) or a URL and the
    environment variable holding the bearer token (HTTP)."""

    command: tuple[str, ...] = ()
    url: str | None = None
    token_env: str | None = None


@dataclass(frozen=True)
class FileEdit:
    """Set ``value`` at ``keys`` in the file at ``path`` (``json`` or ``toml``), keeping the
    rest; ``at_least``: keep a present number that is already as large."""

    path: Path
    kind: Literal["json", "toml"]
    keys: tuple[str, ...]
    value: Any
    at_least: bool = False


@dataclass(frozen=True)
class ClientConfig:
    client: str
    edits: tuple[FileEdit, ...]
    notes: tuple[str, ...]  # what the user should know: timeouts the client cannot be given


def client_timeout_s(largest_deadline_ms: int) -> int:
    """The request timeout a client needs for calls of up to ``largest_deadline_ms``."""
    return math.ceil(largest_deadline_ms / 1000) + MARGIN_S


def check_reach(url: str | None, token_env: str | None) -> None:
    """Check the HTTP options of a set-up before anything is loaded.

    Raises:
        ClientConfigError: a URL without a token variable (or the reverse), a URL that is
            not http(s), or a variable name a shell cannot hold.
    """
    if (url is None) != (token_env is None):
        raise ClientConfigError("--http URL and --token-env VAR go together (serve --http wants a token)")
    if url is not None and not re.match(r"https?://[^/\s]+", url):
        raise ClientConfigError(f"--http wants an http:// or https:// URL, not {url!r}")
    if token_env is not None and not ENV_NAME.fullmatch(token_env):
        raise ClientConfigError(f"--token-env wants an environment variable's name, not {token_env!r}")


def client_config(
    client: str,
    reach: Reach,
    *,
    name: str,
    largest_deadline_ms: int,
    cwd: Path,
    env: Mapping[str, str] | None = None,
) -> ClientConfig:
    """The entries ``client`` needs, in the files it reads.

    Raises:
        ClientConfigError: an unknown client, or HTTP for Claude Desktop (its file starts
            local servers only).
    """
    env = os.environ if env is None else env
    build = _BUILDERS.get(client)
    if build is None:
        raise ClientConfigError(f"unknown client {client!r}; use one of {', '.join(CLIENTS)}")
    where = _Where(name, cwd, Path(env.get("HOME") or Path.home()), env)
    return build(reach, where, largest_deadline_ms)


@dataclass(frozen=True)
class _Where:
    name: str
    cwd: Path
    home: Path
    env: Mapping[str, str]


def _stdio(reach: Reach) -> dict[str, Any]:
    return {"command": reach.command[0], "args": list(reach.command[1:])}


def _claude_desktop(reach: Reach, where: _Where, deadline_ms: int) -> ClientConfig:
    if reach.url is not None:
        raise ClientConfigError(
            "Claude Desktop's file starts local servers only: leave out --http (it starts "
            "runner serve --stdio), or add the URL as a custom connector in its settings"
        )
    notes: tuple[str, ...] = ()
    if client_timeout_s(deadline_ms) > CLAUDE_DESKTOP_LIMIT_S:
        notes = (
            f"Claude Desktop ends a tool call after {CLAUDE_DESKTOP_LIMIT_S} s and has no setting"
            f" for it; the policy's largest deadline is {deadline_ms} ms: keep deadlines under"
            f" {CLAUDE_DESKTOP_LIMIT_S - MARGIN_S} s for it",
        )
    path = claude_desktop_file(where.env, where.home)
    return ClientConfig("claude-desktop", (_json(path, "mcpServers", where.name, _stdio(reach)),), notes)


def _claude_code(reach: Reach, where: _Where, deadline_ms: int) -> ClientConfig:
    if reach.url is not None:
        headers = {"Authorization": f"Bearer ${{{reach.token_env}}}"}  # expanded by Claude Code
        entry: dict[str, Any] = {"type": "http", "url": reach.url, "headers": headers}
    else:
        entry = {"type": "stdio", **_stdio(reach)}
    # MCP_TOOL_TIMEOUT (ms) in the project's settings: one value for every server, only raised.
    timeout_ms = str(client_timeout_s(deadline_ms) * 1000)
    settings = where.cwd / ".claude" / "settings.json"
    timeout = FileEdit(settings, "json", ("env", "MCP_TOOL_TIMEOUT"), timeout_ms, at_least=True)
    server = _json(where.cwd / ".mcp.json", "mcpServers", where.name, entry)
    return ClientConfig("claude-code", (server, timeout), ())


def _editor(client: str) -> Callable[[Reach, _Where, int], ClientConfig]:
    def build(reach: Reach, where: _Where, deadline_ms: int) -> ClientConfig:
        entry = _stdio(reach)
        if reach.url is not None:
            # Both expand ${env:VAR} when they start the connection.
            entry = {"url": reach.url, "headers": {"Authorization": f"Bearer ${{env:{reach.token_env}}}"}}
        if client == "cursor":
            edit = _json(where.home / ".cursor" / "mcp.json", "mcpServers", where.name, entry)
        else:
            entry = {"type": "http" if reach.url is not None else "stdio", **entry}
            edit = _json(where.cwd / ".vscode" / "mcp.json", "servers", where.name, entry)
        note = (
            f"{client} has no request timeout setting in its file; calls may take up to"
            f" {deadline_ms} ms (the policy's largest deadline)"
        )
        return ClientConfig(client, (edit,), (note,))

    return build


def _codex(reach: Reach, where: _Where, deadline_ms: int) -> ClientConfig:
    entry: dict[str, Any] = _stdio(reach)
    if reach.url is not None:
        entry = {"url": reach.url, "bearer_token_env_var": reach.token_env}
    entry.update(startup_timeout_sec=CODEX_STARTUP_S, tool_timeout_sec=client_timeout_s(deadline_ms))
    folder = Path(where.env["CODEX_HOME"]) if where.env.get("CODEX_HOME") else where.home / ".codex"
    edit = FileEdit(folder / "config.toml", "toml", ("mcp_servers", where.name), entry)
    return ClientConfig("codex", (edit,), ())


_BUILDERS = {
    "claude-desktop": _claude_desktop,
    "claude-code": _claude_code,
    "cursor": _editor("cursor"),
    "vscode": _editor("vscode"),
    "codex": _codex,
}


def claude_desktop_file(env: Mapping[str, str], home: Path) -> Path:
    """Where Claude Desktop keeps ``claude_desktop_config.json`` on this system."""
    if sys.platform == "darwin":
        folder = home / "Library" / "Application Support" / "Claude"
    elif sys.platform == "win32":
        folder = Path(env.get("APPDATA") or home / "AppData" / "Roaming") / "Claude"
    else:
        config_home = env.get("XDG_CONFIG_HOME") or ""
        folder = (Path(config_home) if Path(config_home).is_absolute() else home / ".config") / "Claude"
    return folder / "claude_desktop_config.json"


def _json(path: Path, section: str, name: str, entry: dict[str, Any]) -> FileEdit:
    return FileEdit(path, "json", (section, name), entry)
