"""The ``runner client config`` command (registered by ``runner.cli``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from runner.cli._common import EXIT_OK, _fail_usage, _load, _location_options
from runner.config.clients import CLIENTS


@click.group("client")
def client_group() -> None:
    """Set up MCP clients (Claude Desktop, Claude Code, Cursor, VS Code, Codex) to use the runner."""


@client_group.command("config")
@_location_options
@click.argument("client", type=click.Choice(CLIENTS))
@click.option("--http", "url", default=None, metavar="URL", help="Reach runner serve --http at URL.")
@click.option(
    "--token-env",
    default=None,
    metavar="VAR",
    help="With --http: the environment variable the client reads the bearer token from "
    "(the file names VAR, never the token).",
)
@click.option("--role", default=None, help="stdio: the role of the client's calls (default: default_role).")
@click.option("--name", default="runner", show_default=True, help="The server's name in the client.")
@click.option("--write", is_flag=True, help="Merge into the client's own file (backed up, the rest kept).")
@click.pass_context
def config_command(
    ctx: click.Context,
    client: str,
    url: str | None,
    token_env: str | None,
    role: str | None,
    name: str,
    write: bool,
) -> None:
    """What CLIENT needs to start runner serve --stdio (or reach --http URL), with a request
    timeout longer than the policy's largest deadline: printed, or merged with --write."""
    from runner.config.client_files import merge, render
    from runner.config.clients import ClientConfigError, Reach, check_reach, client_config

    try:
        check_reach(url, token_env)
    except ClientConfigError as exc:
        _fail_usage(str(exc))
    if url is not None and role is not None:
        _fail_usage("--role is for stdio; over HTTP the token's entry in serve.tokens gives the role")
    deadline_ms = _largest_deadline_ms(ctx, role, over_http=url is not None)
    try:
        config = client_config(
            client,
            Reach(command=_serve_command(ctx, role), url=_mcp_url(url), token_env=token_env),
            name=name,
            largest_deadline_ms=deadline_ms,
            cwd=Path.cwd(),
        )
        for edit in config.edits:
            if not write:
                click.echo(f"runner: client config: for {edit.path}:", err=True)
                click.echo(render(edit), nl=False)
                continue
            done = merge(edit)
            if not done.changed:
                click.echo(f"runner: client config: {done.path} already has it", err=True)
            elif done.backup is not None:
                click.echo(f"runner: client config: updated {done.path} (backup: {done.backup})", err=True)
            else:
                click.echo(f"runner: client config: wrote {done.path}", err=True)
    except ClientConfigError as exc:
        _fail_usage(str(exc))
    for note in config.notes:
        click.echo(f"runner: client config: {note}", err=True)
    sys.exit(EXIT_OK)


def _largest_deadline_ms(ctx: click.Context, role: str | None, *, over_http: bool) -> int:
    """The longest deadline a call gets without options of its own: over the tools the role
    may call (over HTTP, where each token has its role: over every tool)."""
    from runner.call.plan import resolve_plan
    from runner.call.requests import CallOptions
    from runner.errors import CallError

    runner = _load(ctx)
    try:
        tools = list(runner.registry) if over_http else runner.callable_tools(role)
    except CallError as exc:
        _fail_usage(exc.message)
    deadlines = [resolve_plan(tool, runner.policy, CallOptions()).deadline_ms for tool in tools]
    return max(deadlines, default=runner.policy.model.defaults.deadline_ms or 0)


def _mcp_url(url: str | None) -> str | None:
    """``url``, with runner serve --http's path when it names none."""
    if url is None:
        return None
    scheme, _, rest = url.partition("://")
    return url if "/" in rest.strip("/") else f"{scheme}://{rest.rstrip('/')}/mcp"


def _serve_command(ctx: click.Context, role: str | None) -> tuple[str, ...]:
    """``runner serve --stdio`` as a client starts it: absolute paths, from any folder."""
    from runner.config.locations import find_policy, tool_dirs

    options = ctx.obj
    policy = find_policy(options["policies"]).resolve()
    tools = ":".join(str(path.resolve()) for path in tool_dirs(options["tools"], policy))
    # This Python's own runner, whatever PATH the client starts it with.
    beside = Path(sys.executable).parent / "runner"
    start = [str(beside)] if beside.is_file() else [sys.executable, "-m", "runner"]
    command = [*start, "--tools", tools, "--policies", str(policy)]
    if options["audit_log"] is not None:
        command += ["--audit-log", str(Path(options["audit_log"]).resolve())]
    return (*command, "serve", "--stdio", *(("--role", role) if role else ()))
