"""An MCP server's listed tools as the runner's own tools.

Each listed tool becomes a ``Tool`` whose manifest is the server's (command, sandbox,
limits, network, workspace, env, secrets) with the listed name, description and schemas,
the server manifest's tags plus ``mcp``, and ``hosted`` naming the server and the tool's
own name there. From then on policy, validation, breaker, secrets, egress and audit treat
it as any tool. Everything listed is the server's word, so it is checked as a manifest
would be: a tool whose name or schemas would not pass is left out and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.tools.definitions import MCP_HINTS
from runner.tools.manifest import (
    NAME_PATTERN,
    AnnotationsModel,
    HostedTool,
    LaunchModel,
    ManifestModel,
    ServerEntry,
    Tool,
)
from runner.tools.tool_errors import one_line

MCP_TAG = "mcp"
MAX_DESCRIPTION = 1000
# More tools than this from one server are left out (reported): each is checked at every
# load and exported to agents, and no real server has that many.
MAX_SERVER_TOOLS = 256


class ListingFailed(Exception):
    """The server's tools could not be learnt; the message says why, for the operator."""


@dataclass(frozen=True)
class Expansion:
    """The tools registered for one server, and what was left out and why."""

    tools: list[Tool]
    problems: list[str]


def server_as_tool(entry: ServerEntry) -> Tool:
    """The server itself as a tool with no parameters: what a listing runs."""
    server = entry.manifest
    description = server.description or f"MCP server {server.name}"
    return Tool(
        _manifest(server, server.name, description, {"type": "object"}, None, server.annotations, False),
        entry.directory,
    )


def expand(entry: ServerEntry, listed: list[dict[str, Any]]) -> Expansion:
    """The tools of ``entry`` from its listing (``ListTools``' tools, dumped by alias)."""
    from runner.schema.compiled import SchemaProblem, check_schema

    server = entry.manifest
    by_name = {str(item.get("name")): item for item in listed}
    problems = [
        f"tools: {name} is not a tool of this server" for name in server.tools or () if name not in by_name
    ]
    wanted = [name for name in by_name if server.tools is None or name in server.tools]
    if len(wanted) > MAX_SERVER_TOOLS:
        problems.append(
            f"it lists more than {MAX_SERVER_TOOLS} tools: only the first {MAX_SERVER_TOOLS} are in"
        )
        by_name = {name: by_name[name] for name in wanted[:MAX_SERVER_TOOLS]}
    tools = []
    for own_name, item in by_name.items():
        if server.tools is not None and own_name not in server.tools:
            continue
        name = server.tool_prefix + own_name
        if not NAME_PATTERN.fullmatch(name):
            shown = one_line(repr(name), 80)  # the server's words: printable only
            problems.append(f"{shown} is not a valid tool name ([a-z][a-z0-9_.-]{{0,63}})")
            continue
        parameters, output = item.get("inputSchema"), item.get("outputSchema")
        try:
            if not isinstance(parameters, dict) or parameters.get("type") != "object":
                raise SchemaProblem("inputSchema must be a JSON Schema with type: object")
            check_schema(parameters)
            if output is not None:
                check_schema(output)
        except SchemaProblem as exc:
            problems.append(f"{own_name}: {one_line(str(exc), 200)}")
            continue
        description = str(item.get("description") or f"{own_name} (MCP server {server.name})")
        annotations = _annotations(server.annotations, item.get("annotations"))
        described = description[:MAX_DESCRIPTION]
        manifest = _manifest(server, name, described, parameters, output, annotations, server.session)
        tools.append(Tool(manifest, entry.directory, HostedTool(server=server.name, tool=own_name)))
    return Expansion(tools, problems)


def _manifest(
    server: LaunchModel,
    name: str,
    description: str,
    parameters: dict[str, Any],
    output_schema: dict[str, Any] | None,
    annotations: AnnotationsModel,
    session: bool,
) -> ManifestModel:
    # Every value is checked already (the server's manifest) or here: no second validation.
    launch = {field: getattr(server, field) for field in LaunchModel.model_fields}
    return ManifestModel.model_construct(
        **{
            **launch,
            "name": name,
            "tags": [*server.tags, MCP_TAG] if MCP_TAG not in server.tags else list(server.tags),
            "description": description,
            "parameters": parameters,
            "output_schema": output_schema,
            "annotations": annotations,
            "session": session,
        }
    )


def _annotations(own: AnnotationsModel, listed: object) -> AnnotationsModel:
    """The server's hints, each overridden by the manifest's where it sets one."""
    hints = listed if isinstance(listed, dict) else {}
    values: dict[str, Any] = {}
    for field, hint in MCP_HINTS.items():
        mine = getattr(own, field)
        theirs = hints.get(hint)
        values[field] = mine if mine is not None else theirs if isinstance(theirs, bool) else None
    return AnnotationsModel.model_construct(**values)
