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


@click.group("serve", invoke_without_command=True)
@_location_options
@click.option("--stdio", "stdio", is_flag=True, help="Serve one client on stdin/stdout.")
@click.option("--http", "http", default=None, metavar="HOST:PORT",
              help="Serve streamable HTTP at /mcp (bearer tokens from the policy's serve.tokens).")
@click.option("--role", default=None, help="--stdio: the role of the client's calls (default: default_role).")
@click.pass_context
def serve_group(ctx: click.Context, stdio: bool, http: str | None, role: str | None) -> None:
    """Serve the tools over MCP (SPEC 10): --stdio, or --http HOST:PORT."""
    if ctx.invoked_subcommand is not None:
        return
    if stdio == (http is not None):
        _fail_usage("serve needs exactly one of --stdio and --http HOST:PORT")
    if http is not None and role is not None:
        _fail_usage("--role is for --stdio; over HTTP each token's entry in serve.tokens gives the role")
    from runner.serve.main import serve

    serve(ctx.obj, role=role, http=http)
