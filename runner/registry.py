"""The registry: every valid tool found in the tool directories, by name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runner.hosted.tools import server_as_tool
from runner.manifest import MANIFEST_FILE, ManifestError, ServerEntry, Tool, load_entry
from runner.manifest_cache import ManifestCache


class Lister(Protocol):
    """Learns an MCP server's tools (``runner.hosted.listing.ServerLister``)."""

    def __call__(self, entry: ServerEntry, cache: ManifestCache) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class LoadProblem:
    """A tool folder left out of the registry, and why."""

    path: Path
    reason: str
    folder: str | None = None  # the tool folder's name: by convention the tool's own


class Registry:
    """Tools by name, plus the problems met while loading them."""

    def __init__(self, tools: Iterable[Tool] = (), problems: Iterable[LoadProblem] = ()) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self.problems = list(problems)

    @classmethod
    def load(
        cls,
        directories: Iterable[Path],
        backend_problems: Callable[[Tool], list[str]] | None = None,
        cache: ManifestCache | None = None,
        lister: Lister | None = None,
    ) -> Registry:
        """Load every ``*/tool.yaml`` under ``directories``; bad ones become problems, and so
        do tools whose backend refuses them (``backend_problems``: not installed, or a rule
        of the backend's own such as docker's ``image``). ``cache`` (default: the user's,
        ``runner.manifest_cache``) remembers the manifests already checked. An MCP server's
        folder (``kind: mcp``) gives the tools ``lister`` learns from it (SPEC 12); without
        a lister, or when it fails, the server is a problem and none of its tools is in."""
        cache = cache if cache is not None else ManifestCache.open()
        tools: dict[str, Tool] = {}
        problems: list[LoadProblem] = []
        servers: list[ServerEntry] = []
        for root in directories:
            if not root.is_dir():
                problems.append(LoadProblem(root, "tool directory does not exist"))
                continue
            for folder in sorted(p for p in root.iterdir() if (p / MANIFEST_FILE).is_file()):
                try:
                    entry = load_entry(folder, cache)
                except ManifestError as exc:
                    problems.append(LoadProblem(exc.path, exc.reason, folder.name))
                    continue
                if isinstance(entry, ServerEntry):
                    servers.append(entry)  # after every tool of its own: it never shadows one
                    continue
                if _admitted(entry, backend_problems, problems):
                    _add(tools, entry, problems)
        for server in servers:
            if _admitted(server_as_tool(server), backend_problems, problems):
                for tool in _server_tools(server, cache, lister, problems):
                    _add(tools, tool, problems)
        cache.save()
        return cls(tools.values(), problems)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def left_out(self, name: str) -> bool:
        """Whether a tool of that name was found but left out (its manifest is invalid)."""
        return name not in self._tools and any(problem.folder == name for problem in self.problems)

    def __iter__(self) -> Iterator[Tool]:
        return iter(sorted(self._tools.values(), key=lambda t: t.name))

    def __len__(self) -> int:
        return len(self._tools)


def matches_filter(tool: Tool, text: str | None) -> bool:
    """Case-insensitive substring match on name, description and tags."""
    if not text:
        return True
    needle = text.lower()
    manifest = tool.manifest
    haystack = [manifest.name, manifest.description, *manifest.tags]
    return any(needle in part.lower() for part in haystack)


def _admitted(
    tool: Tool, backend_problems: Callable[[Tool], list[str]] | None, problems: list[LoadProblem]
) -> bool:
    """Whether the tool's backend takes it (a server's is checked before it is started)."""
    refused = backend_problems(tool) if backend_problems is not None else []
    if refused:
        problems.append(LoadProblem(tool.directory / MANIFEST_FILE, "; ".join(refused), tool.name))
    return not refused


def _add(tools: dict[str, Tool], tool: Tool, problems: list[LoadProblem]) -> None:
    if tool.name in tools:
        first = tools[tool.name].directory / MANIFEST_FILE
        where = tool.directory / MANIFEST_FILE
        problems.append(LoadProblem(where, f"duplicate tool name {tool.name!r} (first defined in {first})"))
        return
    tools[tool.name] = tool


def _server_tools(
    entry: ServerEntry, cache: ManifestCache, lister: Lister | None, problems: list[LoadProblem]
) -> list[Tool]:
    """The tools of an MCP server's folder; what keeps it, or some of its tools, out goes
    to ``problems``."""
    from runner.hosted.listing import ListingFailed
    from runner.hosted.tools import expand

    path = entry.directory / MANIFEST_FILE
    name = entry.manifest.name
    if lister is None:
        problems.append(LoadProblem(path, "an MCP server, not listed here (no sandbox to start it in)", name))
        return []
    try:
        listed = lister(entry, cache)
    except ListingFailed as exc:
        problems.append(LoadProblem(path, f"MCP server {name} cannot be listed: {exc}", name))
        return []
    expansion = expand(entry, listed)
    problems += [LoadProblem(path, f"MCP server {name}: {problem}", name) for problem in expansion.problems]
    return expansion.tools
