"""``runner new``, ``runner list``, ``runner show`` and ``runner validate``: the tools."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from runner.errors import ConfigError

if TYPE_CHECKING:
    pass

from runner.cli._common import EXIT_FAILED, EXIT_OK, _fail_usage, _load, _location_options, _print_json


@click.command("new")
@_location_options
@click.argument("name")
@click.option(
    "--lang",
    type=click.Choice(["python", "sh"]),
    default="python",
    show_default=True,
    help="python: main.py using the runner_tool helper; sh: a shell script.",
)
@click.option("--docker", is_flag=True, help="Run it in the docker sandbox (needs `runner images build`).")
@click.pass_context
def new_command(ctx: click.Context, name: str, lang: str, docker: bool) -> None:
    """Scaffold tools/NAME: tool.yaml, the program and sample.json params."""
    from runner.config.locations import find_policy, tool_dirs
    from runner.tools.scaffold import ScaffoldError, new_tool

    try:
        explicit = ctx.obj["tools"]
        policy = Path() if explicit else find_policy(ctx.obj["policies"])
        directories = tool_dirs(explicit, policy)
        if not directories:
            _fail_usage("--tools names no folder")
        made = new_tool(directories[0], name, lang=lang, docker=docker)
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))
    except ScaffoldError as exc:
        _fail_usage(str(exc))
    except OSError as exc:
        _fail_usage(f"cannot write the tool: {exc.strerror or exc}")
    click.echo(f"wrote {', '.join(path.name for path in made.written)} into {made.folder}")
    sample = made.sample.resolve()
    shown = sample.relative_to(Path.cwd()) if sample.is_relative_to(Path.cwd()) else sample
    click.echo(f"try: runner exec {name} --params @{shown}")


@click.command("list")
@_location_options
@click.option(
    "--filter",
    "filter_text",
    default=None,
    help="Only tools whose name, description or tags contain TEXT (any case).",
)
@click.option("--role", default=None, help="List for this role (default: the policy's default_role).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the default when piped is plain lines).")
@click.pass_context
def list_command(ctx: click.Context, filter_text: str | None, role: str | None, as_json: bool) -> None:
    """The tools a role may call."""
    from runner.errors import CallError

    runner = _load(ctx)
    for problem in runner.registry.problems:  # stderr: the listing itself stays machine-readable
        click.echo(f"runner: warning: {problem.path}: {problem.reason} (left out)", err=True)
    try:
        tools = runner.discover(filter=filter_text, role=role)
    except CallError as exc:
        _fail_usage(exc.message)
    if as_json:
        _print_json({"tools": tools, "total": len(tools)})
        return
    from runner.cli.terminal import Output, print_tools

    out = Output.detect()
    if out.human:
        print_tools(tools, out)
        return
    from runner.tools.tool_errors import printable  # a description may be a third party's words

    for tool in tools:
        tags = printable(",".join(tool["metadata"]["tags"]))
        line = (
            f"{tool['name']:<20} {tool['metadata']['sandbox']:<10} [{tags}] {printable(tool['description'])}"
        )
        click.echo(line)


@click.command("show")
@_location_options
@click.argument("tool")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the default when piped).")
@click.pass_context
def show_command(ctx: click.Context, tool: str, as_json: bool) -> None:
    """One tool: description, schemas, resolved limits, what it asks for, which roles may call it.

    Exits 1 when no registered tool has that name.
    """
    from runner.cli.terminal import Output, print_tool_sheet
    from runner.cli.tool_sheet import UnknownTool, tool_sheet

    runner = _load(ctx)
    try:
        sheet = tool_sheet(runner, tool)
    except UnknownTool as exc:
        click.echo(f"runner: {exc.message}", err=True)
        sys.exit(EXIT_FAILED)
    out = Output.detect()
    if as_json or not out.human:
        _print_json(sheet)
    else:
        print_tool_sheet(sheet, out)


@click.command("validate")
@_location_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document: tools, problems, counts.")
@click.pass_context
def validate_command(ctx: click.Context, as_json: bool) -> None:
    """Load tools and policies, report every problem, list the registry (exit 1 on an error)."""
    from runner.cli.validate import human_lines, validate, wire

    runner = _load(ctx)
    report = validate(runner.registry, runner.policy)
    if as_json:
        _print_json(wire(report, runner.policy))
    else:
        human_lines(report, click.echo, runner.policy)
    sys.exit(EXIT_FAILED if report.errors else EXIT_OK)
