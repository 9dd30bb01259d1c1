"""``runner mcp list`` and ``runner mcp remove``: the servers installed in the tool folders.

A server is a folder whose ``tool.yaml`` says ``kind: mcp``. Removal takes only such a folder,
never a symlink (as root, a link planted in the tools folder must not aim the removal
elsewhere), and leaves the policy alone: its grants are named so a person can take them out.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.call.policy import Policy
from runner.config.yaml_files import YamlFileError, load_yaml_file
from runner.tools.manifest import MANIFEST_FILE


@dataclass(frozen=True)
class Server:
    """An installed server: its folder and what its manifest says."""

    name: str
    folder: Path
    description: str
    command: tuple[str, ...]
    workspace: str

    def wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "folder": str(self.folder),
            "description": self.description,
            "command": list(self.command),
            "workspace": self.workspace,
        }


class RemoveError(Exception):
    """The folder is not an installed server's, or cannot be removed; ``message`` says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def servers(tool_dirs: Sequence[Path]) -> Iterator[Server]:
    """Every ``kind: mcp`` folder of ``tool_dirs``, by name (a broken manifest is skipped:
    ``runner validate`` reports it)."""
    for tools_dir in tool_dirs:
        if not tools_dir.is_dir():
            continue
        for folder in sorted(tools_dir.iterdir()):
            server = _server(folder)
            if server is not None:
                yield server


def _server(folder: Path) -> Server | None:
    if folder.is_symlink() or not folder.is_dir() or folder.name.startswith("."):
        return None
    try:
        manifest = load_yaml_file(folder / MANIFEST_FILE)
    except (OSError, YamlFileError):
        return None
    if not isinstance(manifest, dict) or manifest.get("kind") != "mcp":
        return None
    command = manifest.get("command")
    return Server(
        name=str(manifest.get("name", folder.name)),
        folder=folder,
        description=str(manifest.get("description", "")),
        command=tuple(str(part) for part in command) if isinstance(command, list) else (),
        workspace=str(manifest.get("workspace", "none")),
    )


def remove_server(tool_dirs: Sequence[Path], name: str) -> Server:
    """Remove the installed server ``name``'s folder.

    Raises:
        RemoveError: no installed server has that name, or its folder cannot be removed.
    """
    found = [server for server in servers(tool_dirs) if server.name == name]
    if not found:
        raise RemoveError(f"no MCP server named {name!r} is installed (runner mcp list shows them)")
    server = found[0]
    try:
        shutil.rmtree(server.folder)  # never follows a symlink inside the folder
    except OSError as exc:
        raise RemoveError(f"cannot remove {server.folder}: {exc.strerror or exc}") from exc
    return server


def policy_mentions(policy: Policy, server: str) -> list[str]:
    """Where the policy still names the server's tools (``SERVER_*`` patterns and entries)."""
    prefix = f"{server}_"
    model = policy.model
    found = [f"whitelist: {entry}" for entry in model.whitelist if entry.startswith(prefix)]
    for role, entry in model.roles.items():
        found += [f"roles.{role}.allow: {rule}" for rule in entry.allow if rule.startswith(prefix)]
        found += [f"roles.{role}.deny: {rule}" for rule in entry.deny if rule.startswith(prefix)]
    found += [f"tools.{tool}" for tool in model.tools if tool.startswith(prefix) or tool == server]
    return found
