"""The registry: every valid tool found in the tool directories, by name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runner.tools.cache import ManifestCache
from runner.tools.hosted import ListingFailed, expand, server_as_tool
from runner.tools.manifest import MANIFEST_FILE, ManifestError, ServerEntry, Tool, load_entry


class Lister(Protocol):
    """Learns an MCP server's tools (the MCP side's ``ServerLister``)."""

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
        ``runner.tools.cache``) remembers the manifests already checked. An MCP server's
        folder (``kind: mcp``) gives the tools ``lister`` learns from it; without
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
        admitted = [
            server
            for server in _unshared_names(servers, problems)
            if _admitted(server_as_tool(server), backend_problems, problems)
        ]
        hosted = _hosted_tools(admitted, cache, lister, problems)
        plain = set(tools)
        for tool in hosted:
            _add(tools, tool, problems)
        _drop_contested(tools, plain, hosted, problems)
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


# Servers listed at once (each in a sandbox of its own): a load waits for the slowest,
# not for their sum.
LISTING_THREADS = 4


def _hosted_tools(
    servers: list[ServerEntry], cache: ManifestCache, lister: Lister | None, problems: list[LoadProblem]
) -> list[Tool]:
    """The tools of every server, listed concurrently; problems in the servers' order."""
    if not servers:
        return []
    with ThreadPoolExecutor(min(LISTING_THREADS, len(servers)), thread_name_prefix="runner-lists") as threads:
        found = list(threads.map(lambda server: _server_tools(server, cache, lister), servers))
    tools: list[Tool] = []
    for server_tools, server_problems in found:
        tools += server_tools
        problems += server_problems
    return tools


def _unshared_names(servers: list[ServerEntry], problems: list[LoadProblem]) -> list[ServerEntry]:
    """The servers whose name no other server's folder uses. A server's name is what its
    tools' calls, its session run and its grants go by: two folders of one name (a
    third-party one named as a trusted one) serve neither, whatever their order."""
    folders: dict[str, list[ServerEntry]] = {}
    for server in servers:
        folders.setdefault(server.manifest.name, []).append(server)
    for name, sharing in folders.items():
        if len(sharing) > 1:
            where = ", ".join(str(server.directory) for server in sharing)
            reason = f"MCP server name {name!r} is used by more than one folder ({where}): left out of all"
            problems.extend(LoadProblem(server.directory / MANIFEST_FILE, reason, name) for server in sharing)
    return [server for server in servers if len(folders[server.manifest.name]) == 1]


def _drop_contested(
    tools: dict[str, Tool], plain: set[str], hosted: list[Tool], problems: list[LoadProblem]
) -> None:
    """A name two servers both list (``a`` listing ``b_x``, ``a_b`` listing ``x``) serves
    neither: who would answer it, and with whose grants, must never depend on load order."""
    claims: dict[str, list[Tool]] = {}
    for tool in hosted:
        if tool.name not in plain:
            claims.setdefault(tool.name, []).append(tool)
    for name, claimants in claims.items():
        servers = sorted({tool.hosted.server for tool in claimants if tool.hosted is not None})
        if len(servers) > 1:
            del tools[name]
            where = claimants[0].directory / MANIFEST_FILE
            reason = f"{name!r} is listed by more than one MCP server ({', '.join(servers)}): left out of all"
            problems.append(LoadProblem(where, reason, name))


def _server_tools(
    entry: ServerEntry, cache: ManifestCache, lister: Lister | None
) -> tuple[list[Tool], list[LoadProblem]]:
    """The tools of an MCP server's folder; what keeps it, or some of its tools, out goes
    to ``problems``."""
    path = entry.directory / MANIFEST_FILE
    name = entry.manifest.name
    if lister is None:
        return [], [LoadProblem(path, "an MCP server, not listed here (no sandbox to start it in)", name)]
    try:
        listed = lister(entry, cache)
    except ListingFailed as exc:
        return [], [LoadProblem(path, f"MCP server {name} cannot be listed: {exc}", name)]
    expansion = expand(entry, listed)
    return expansion.tools, [LoadProblem(path, f"MCP server {name}: {p}", name) for p in expansion.problems]
