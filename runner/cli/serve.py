"""The ``runner export`` and ``runner serve`` commands (registered by ``runner.cli``)."""

from __future__ import annotations

import sys

import click

from runner.cli._common import EXIT_OK, _fail_usage, _load, _location_options, _print_json
from runner.errors import CallError, ConfigError
from runner.tools.definitions import FORMATS, STRICT_FORMATS, definitions


@click.command("export")
@_location_options
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    required=True,
    help="openai (Chat Completions functions), openai-responses (Responses API functions), "
    "anthropic (tools) or mcp (as tools/list gives them).",
)
@click.option(
    "--strict",
    is_flag=True,
    help="OpenAI formats: schemas for strict mode (optional properties required and nullable; "
    "a null there counts as left out).",
)
@click.option("--role", default=None, help="Export the tools this role may call (default: default_role).")
@click.pass_context
def export_command(ctx: click.Context, fmt: str, strict: bool, role: str | None) -> None:
    """Tool definitions for an agent, as one JSON list; what a format cannot express goes to stderr."""
    if strict and fmt not in STRICT_FORMATS:
        _fail_usage(f"--strict is for --format {' and '.join(STRICT_FORMATS)}")
    runner = _load(ctx)
    try:
        exported = definitions(runner.callable_tools(role), fmt, strict=strict)
    except CallError as exc:
        _fail_usage(exc.message)
    for note in exported.notes:
        click.echo(f"runner: export: {note.tool}: {note.problem}", err=True)
    _print_json(exported.tools)
    sys.exit(EXIT_OK)


@click.group("serve", invoke_without_command=True)
@_location_options
@click.option("--stdio", "stdio", is_flag=True, help="Serve one client on stdin/stdout.")
@click.option(
    "--http",
    "http",
    default=None,
    metavar="HOST:PORT",
    help="Serve streamable HTTP at /mcp (bearer tokens from the policy's serve.tokens).",
)
@click.option(
    "--socket",
    "socket_path",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[PATH]",
    help="Also (or only) take runner exec's calls on a Unix socket "
    "(default runner/serve.sock in the user's own $XDG_RUNTIME_DIR or /run/user/UID, "
    "else $TMPDIR/runner-UID/serve.sock); see serve.socket in the policy.",
)
@click.option("--role", default=None, help="--stdio: the role of the client's calls (default: default_role).")
@click.option(
    "--metrics",
    "metrics",
    default=None,
    metavar="HOST:PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (a PORT alone: on 127.0.0.1). "
    "They name every tool, admin-only ones included: see --metrics-token-env.",
)
@click.option(
    "--metrics-token-env",
    "metrics_token_env",
    default=None,
    metavar="VAR",
    help="/metrics answers only requests with Authorization: Bearer $VAR (others: 401).",
)
@click.pass_context
def serve_group(
    ctx: click.Context,
    stdio: bool,
    http: str | None,
    role: str | None,
    metrics: str | None,
    metrics_token_env: str | None,
    socket_path: str | None,
) -> None:
    """Serve the tools over MCP: --stdio, or --http HOST:PORT; each call is a
    span of the caller's trace (_meta.traceparent, or the HTTP traceparent header).
    --socket, beside either or alone, answers runner exec on a local socket."""
    if ctx.invoked_subcommand is not None:
        return
    if stdio and http is not None:
        _fail_usage("serve takes one of --stdio and --http HOST:PORT, not both")
    if not stdio and http is None and socket_path is None:
        _fail_usage("serve needs --stdio, --http HOST:PORT or --socket [PATH]")
    if not stdio and role is not None:
        _fail_usage(
            "--role is for --stdio; over HTTP each token's entry in serve.tokens gives the role, "
            "over --socket the caller's runner exec"
        )
    from runner.cli.serve_main import serve

    serve(
        ctx.obj,
        role=role,
        http=http,
        metrics=metrics,
        metrics_token_env=metrics_token_env,
        socket_path=socket_path,
        stdio=stdio,
    )


@serve_group.group("tokens")
def tokens_group() -> None:
    """Bearer tokens of runner serve --http (kept in the policy as SHA-256 digests)."""


@tokens_group.command("add")
@_location_options
@click.argument("name")
@click.option("--role", required=True, help="The role the token's calls get.")
@click.pass_context
def tokens_add_command(ctx: click.Context, name: str, role: str) -> None:
    """Make a token NAME with ROLE: print it (once) and store its digest in the policy file."""
    from runner.config.locations import find_policy
    from runner.mcp.serve.tokens import add_token

    try:
        token = add_token(find_policy(ctx.find_root().obj["policies"]), name, role)
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))
    click.echo(token)
    click.echo(f"runner: token {name!r} (role {role}) added; it is shown only this once", err=True)
