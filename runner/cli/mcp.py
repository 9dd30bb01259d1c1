"""The ``runner mcp`` commands (registered by ``runner.cli``)."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from runner.cli._common import EXIT_FAILED, _fail_usage, _load, _location_options, _print_json
from runner.errors import ConfigError

if TYPE_CHECKING:
    from types import FrameType

    from runner.api import Runner
    from runner.mcp.hosted.install import Asks, Installed, Source
    from runner.tools.manifest import Tool


@click.group("mcp")
def mcp_group() -> None:
    """Third-party MCP servers, hosted as sandboxed tools."""


@mcp_group.command("add")
@_location_options
@click.argument("name")
@click.option(
    "--pip",
    "pip_package",
    default=None,
    metavar="PACKAGE",
    help="Install this PyPI package (wheels only) into a virtual environment.",
)
@click.option(
    "--module",
    default=None,
    help="--pip: the module `python -m` runs (default: the package name, '-' as '_').",
)
@click.option(
    "--npm",
    "npm_package",
    default=None,
    metavar="PACKAGE",
    help="Install this npm package (install scripts off) into node_modules.",
)
@click.option(
    "--bin",
    "bin_name",
    default=None,
    metavar="B",
    help="--npm: which of the package's programs to run, when it has several.",
)
@click.option(
    "--workspace",
    type=click.Choice(["none", "read", "write"]),
    default="none",
    help="Whether the server sees the policy's workspace at /workspace, read-only or writable.",
)
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    metavar="NAME",
    help="A secret the server needs, as an environment variable (the policy grants it). Repeatable.",
)
@click.option(
    "--env",
    "env_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="A fixed environment variable of the server (never a secret). Repeatable.",
)
@click.option(
    "--session",
    is_flag=True,
    help="One server per session, kept between that session's calls (session: true).",
)
@click.option(
    "--grant",
    "grant_role",
    default=None,
    metavar="ROLE",
    help="Also edit the policy so that ROLE may call the server's tools (comments kept).",
)
@click.option("--force", is_flag=True, help="Replace the tool folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def add_command(
    ctx: click.Context,
    name: str,
    pip_package: str | None,
    module: str | None,
    npm_package: str | None,
    bin_name: str | None,
    workspace: str,
    secrets: tuple[str, ...],
    env_pairs: tuple[str, ...],
    session: bool,
    grant_role: str | None,
    force: bool,
    as_json: bool,
    args: tuple[str, ...],
) -> None:
    """Install an MCP server's package into tools/NAME and write its manifest (kind: mcp).

    ARGS (after --) are passed to the server. Then lists the tools it registers and what the
    policy must grant before they can be called (--grant ROLE grants it). Exits 1 when the
    server registers no tools, with what to change.
    """
    from runner.cli.interrupt import Interrupted
    from runner.mcp.hosted.install import Asks, add_server
    from runner.mcp.hosted.packages import McpAddError

    source = _source(pip_package, module, npm_package, bin_name)
    asks = Asks(workspace, tuple(dict.fromkeys(secrets)), _env(env_pairs), session)
    tools_dir = _tools_dir(ctx)
    if grant_role is not None and grant_role not in (roles := _load(ctx).policy.model.roles):
        _fail_usage(f"--grant {grant_role}: the policy has no such role (it has {', '.join(roles)})")
    say = _progress(as_json)
    say(f"installing {source.package} from {source.registry} into {tools_dir / name} ...")
    try:
        with _stopped_by_signals():
            installed = add_server(tools_dir, name, source, args, force=force, asks=asks)
    except Interrupted as stopped:  # the package manager is gone and the half folder removed
        sys.exit(128 + stopped.signum)
    except McpAddError as exc:
        output = exc.output.strip()
        _fail_usage(exc.message + (f"\n{output}" if output and not as_json else ""))
    except OSError as exc:
        _fail_usage(f"cannot write the tool folder: {exc.strerror or exc}")
    if grant_role is not None:
        say(f"granting role {grant_role} what the server asks for ...")
        _grant(ctx, installed, grant_role)
    say("starting the server in its sandbox to list its tools ...")
    report = _report(installed, _load(ctx), grant_role)
    if grant_role is not None and report["grants"]:
        _grant(ctx, installed, grant_role)  # its real tools may ask for more than the stand-in
        report = _report(installed, _load(ctx), grant_role)
    if as_json:
        _print_json(report)
    else:
        _print_report(report)
    if not report["tools"]:
        click.echo(f"runner: {_no_tools_fix(report, asks)}", err=True)
        sys.exit(EXIT_FAILED)


def _progress(quiet: bool) -> Callable[[str], None]:
    """Lines on stderr while an install runs (it may take a minute), none for --json."""
    if quiet:
        return lambda _text: None
    return lambda text: click.echo(f"runner: {text}", err=True)


def _env(pairs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    parsed = []
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key:
            _fail_usage(f"--env {pair!r} is not KEY=VALUE")
        parsed.append((key, value))
    return tuple(parsed)


def _grant(ctx: click.Context, installed: Installed, role: str) -> None:
    """Merge into the policy file what ``role`` needs to call the server's tools."""
    import yaml  # not at import: `runner --help` loads this module

    from runner.call.policy import Policy
    from runner.call.policy_edit import edit_policy, merge_into
    from runner.mcp.hosted.grants import needed_grants

    runner = _load(ctx)
    hosted = _hosted_by(runner, installed.name)
    manifest = yaml.safe_load(installed.manifest.read_text(encoding="utf-8"))
    grants = needed_grants(runner.policy, installed.name, hosted, manifest, role)
    for removal in grants.removals:
        click.echo(f"runner: --grant cannot lift this, edit the policy by hand: {removal}", err=True)
    if grants.additions:
        policy_path = Path(runner.policy.source)
        try:
            edit_policy(
                policy_path, lambda document: merge_into(document, grants.additions), "nothing was granted:"
            )
        except ConfigError as exc:
            _fail_usage(" ".join(str(exc).split()))
        Policy.load(policy_path)  # as the runner will read it


def _no_tools_fix(report: dict[str, Any], asks: Asks) -> str:
    """Why a server registered no tools, and what usually fixes it."""
    fixes = [f"edit {report['manifest']} or run runner mcp add again with --force and"]
    if asks.workspace == "none":
        fixes.append("--workspace read|write if the server works on files (it then sees /workspace),")
    fixes.append("the arguments the server expects after --, or --secret NAME for a key it needs")
    return f"{report['name']} registered no tools (the problem is above): " + " ".join(fixes)


@mcp_group.command("list")
@_location_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.pass_context
def list_command(ctx: click.Context, as_json: bool) -> None:
    """The MCP servers installed in the tool folders, and the tools each registers."""
    from runner.audit.query import escape_cell as inert
    from runner.mcp.hosted.manage import servers

    runner = _load(ctx)
    found = []
    for server in servers(_all_tool_dirs(ctx)):
        tools = sorted(tool.name for tool in _hosted_by(runner, server.name))
        problems = [p.reason for p in runner.registry.problems if p.folder == server.folder.name]
        found.append({**server.wire(), "tools": tools, "problems": problems})
    if as_json:
        _print_json({"servers": found})
        return
    if not found:
        click.echo("no MCP servers installed (runner mcp add installs one)")
    for entry in found:
        names = ", ".join(entry["tools"]) or "none registered"
        click.echo(f"{inert(entry['name'])}: {inert(entry['description'])}")
        click.echo(f"  folder {inert(entry['folder'])}, workspace {inert(entry['workspace'])}")
        click.echo(f"  tools: {inert(names)}")
        for problem in entry["problems"]:
            click.echo(f"  problem: {inert(problem)}")


@mcp_group.command("remove")
@_location_options
@click.argument("name")
@click.pass_context
def remove_command(ctx: click.Context, name: str) -> None:
    """Remove an installed MCP server's folder. The policy is left as it is: the lines that
    still name the server's tools are printed, to take out by hand."""
    from runner.mcp.hosted.manage import RemoveError, policy_mentions, remove_server

    try:
        server = remove_server(_all_tool_dirs(ctx), name)
    except RemoveError as exc:
        click.echo(f"runner: {exc.message}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(f"removed {server.folder}")
    mentions = policy_mentions(_load(ctx).policy, name)
    if mentions:
        click.echo("the policy still mentions its tools (harmless, but you may take them out):")
        for mention in mentions:
            click.echo(f"  {mention}")


def _all_tool_dirs(ctx: click.Context) -> list[Path]:
    from runner.config.locations import find_policy, tool_dirs

    try:
        explicit = ctx.obj["tools"]
        return tool_dirs(explicit, Path() if explicit else find_policy(ctx.obj["policies"]))
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Ctrl-C or SIGTERM raises ``Interrupted`` where the install is, so that its cleanup
    runs (the package manager's session killed, the half-made folder removed); the signals
    that follow are ignored until it is done."""
    from runner.cli.interrupt import STOP_SIGNALS, Interrupted

    def stop(signum: int, _frame: FrameType | None) -> None:
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        raise Interrupted(signum)

    before = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _source(
    pip_package: str | None, module: str | None, npm_package: str | None, bin_name: str | None
) -> Source:
    from runner.mcp.hosted.install import NpmSource, PipSource

    if (pip_package is None) == (npm_package is None):
        _fail_usage("mcp add needs exactly one of --pip PACKAGE and --npm PACKAGE")
    if pip_package is not None:
        if bin_name is not None:
            _fail_usage("--bin goes with --npm; for --pip, --module names what runs")
        return PipSource(pip_package, module)
    assert npm_package is not None
    if module is not None:
        _fail_usage("--module goes with --pip; for --npm, --bin names what runs")
    return NpmSource(npm_package, bin_name)


def _tools_dir(ctx: click.Context) -> Path:
    """The first tool directory, as ``runner new`` finds it."""
    directories = _all_tool_dirs(ctx)
    if not directories:
        _fail_usage("--tools names no folder")
    return directories[0]


def _report(installed: Installed, runner: Runner, role: str | None = None) -> dict[str, Any]:
    """What was installed, the server's registered tools and load problems, and the grants."""
    import yaml

    from runner.mcp.hosted.grants import needed_grants

    hosted = _hosted_by(runner, installed.name)
    problems = [p for p in runner.registry.problems if p.folder == installed.name]
    manifest = yaml.safe_load(installed.manifest.read_text(encoding="utf-8"))
    grants = needed_grants(runner.policy, installed.name, hosted, manifest, role)
    return {
        "name": installed.name,
        "package": installed.source.package,
        "registry": installed.source.registry,
        "folder": str(installed.folder),
        "manifest": str(installed.manifest),
        "command": list(installed.command),
        "tools": [{"name": tool.name, "description": tool.manifest.description} for tool in hosted],
        "problems": [{"path": str(p.path), "reason": p.reason} for p in problems],
        "policy": runner.policy.source,
        "role": grants.role,
        "grants": grants.additions,
        "removals": list(grants.removals),
        "grantsYaml": "\n".join(grants.yaml_lines()),
    }


def _print_report(report: dict[str, Any]) -> None:
    """The report for a person. The tools' names and descriptions come from the server, the
    problems from its folder: every such string is escaped, so that none can drive the
    terminal (an ESC sequence retitling the window or clearing the screen)."""
    from runner.audit.query import escape_cell as inert

    echo = click.echo
    echo(f"installed {report['package']} ({report['registry']}) into {inert(report['folder'])}")
    echo(f"manifest: {inert(report['manifest'])}")
    echo(f"command: {inert(' '.join(report['command']))}")
    if report["tools"]:
        echo(f"tools ({len(report['tools'])}):")
        for tool in report["tools"]:
            description = " ".join(tool["description"].split())[:80]
            echo(f"  {inert(tool['name']):<28} {inert(description)}")
    else:
        echo("tools: none registered")
    for problem in report["problems"]:
        echo(f"problem: {inert(problem['path'])}: {inert(problem['reason'])}")
    role = inert(report["role"] or "(no default_role)")
    if report["grants"]:
        echo(
            f"the policy must grant, for role {role} (--grant {role} does it, or edit "
            f"{inert(report['policy'])}):"
        )
        for where, value in _flat(report["grants"]):
            echo(f"  {inert(where)}: {'add ' if isinstance(value, list) else ''}{inert(json.dumps(value))}")
    for removal in report["removals"]:
        echo(f"the policy refuses them: {inert(removal)}")
    if not report["grants"] and not report["removals"]:
        echo(f"the policy already lets role {role} call them")


def _flat(additions: dict[str, Any], where: str = "") -> Iterator[tuple[str, Any]]:
    """``roles.user.allow``-style paths and what goes there: unlike a YAML snippet, nothing
    to clash with keys the file already has."""
    for key, value in additions.items():
        path = f"{where}.{key}" if where else key
        if isinstance(value, dict):
            yield from _flat(value, path)
        else:
            yield path, value


def _hosted_by(runner: Runner, server: str) -> list[Tool]:
    return [tool for tool in runner.registry if tool.hosted is not None and tool.hosted.server == server]
