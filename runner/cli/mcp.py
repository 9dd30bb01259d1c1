"""The ``runner mcp`` commands (registered by ``runner.cli``)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from runner.cli._common import _fail_usage, _load, _location_options, _print_json
from runner.errors import ConfigError

if TYPE_CHECKING:
    from types import FrameType

    from runner.api import Runner
    from runner.mcp.hosted.install import Installed, Source


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
    force: bool,
    as_json: bool,
    args: tuple[str, ...],
) -> None:
    """Install an MCP server's package into tools/NAME and write its manifest (kind: mcp).

    ARGS (after --) are passed to the server. Then lists the tools it registers and what the
    policy must grant before they can be called.
    """
    from runner.mcp.hosted.install import add_server
    from runner.mcp.hosted.packages import McpAddError

    source = _source(pip_package, module, npm_package, bin_name)
    from runner.cli.interrupt import Interrupted

    tools_dir = _tools_dir(ctx)
    try:
        with _stopped_by_signals():
            installed = add_server(tools_dir, name, source, args, force=force)
    except Interrupted as stopped:  # the package manager is gone and the half folder removed
        sys.exit(128 + stopped.signum)
    except McpAddError as exc:
        output = exc.output.strip()
        _fail_usage(exc.message + (f"\n{output}" if output and not as_json else ""))
    except OSError as exc:
        _fail_usage(f"cannot write the tool folder: {exc.strerror or exc}")
    report = _report(installed, _load(ctx))
    if as_json:
        _print_json(report)
    else:
        _print_report(report)


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
    from runner.config.locations import find_policy, tool_dirs

    try:
        explicit = ctx.obj["tools"]
        directories = tool_dirs(explicit, Path() if explicit else find_policy(ctx.obj["policies"]))
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))
    if not directories:
        _fail_usage("--tools names no folder")
    return directories[0]


def _report(installed: Installed, runner: Runner) -> dict[str, Any]:
    """What was installed, the server's registered tools and load problems, and the grants."""
    import yaml  # not at import: `runner --help` loads this module

    from runner.mcp.hosted.grants import needed_grants

    hosted = [
        tool for tool in runner.registry if tool.hosted is not None and tool.hosted.server == installed.name
    ]
    problems = [p for p in runner.registry.problems if p.folder == installed.name]
    manifest = yaml.safe_load(installed.manifest.read_text(encoding="utf-8"))
    grants = needed_grants(runner.policy, installed.name, hosted, manifest)
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
    if report["grantsYaml"]:
        echo(f"the policy must grant, for role {role} (add to {inert(report['policy'])}):")
        for line in report["grantsYaml"].splitlines():
            echo(f"  {inert(line)}")
    for removal in report["removals"]:
        echo(f"the policy refuses them: {inert(removal)}")
    if not report["grantsYaml"] and not report["removals"]:
        echo(f"the policy already lets role {role} call them")
