"""The ``runner export`` and ``runner serve`` commands (registered by ``runner.cli``)."""

from __future__ import annotations

import sys

import click

from runner.cli import EXIT_OK, _fail_usage, _load, _location_options, _print_json
from runner.errors import CallError
from runner.serve.definitions import FORMATS, definitions


@click.command("export")
@_location_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True)
@click.option("--role", default=None, help="Export the tools this role may call (default: default_role).")
@click.pass_context
def export_command(ctx: click.Context, fmt: str, role: str | None) -> None:
    """Tool definitions for an agent, as one JSON list; what a format cannot express goes to stderr."""
    runner = _load(ctx)
    try:
        exported = definitions(runner.callable_tools(role), fmt)
    except CallError as exc:
        _fail_usage(exc.message)
    for note in exported.notes:
        click.echo(f"runner: export: {note.tool}: {note.problem}", err=True)
    _print_json(exported.tools)
    sys.exit(EXIT_OK)
