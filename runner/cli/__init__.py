"""The command line. Exit codes: 0 success, 1 the call failed, 2 misuse.

Nothing a user can cause prints a traceback: configuration problems become one line on
stderr and exit 2; call failures are answers on stdout and exit 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from runner.cli._common import _AUDIT_HELP, _POLICIES_HELP, _TOOLS_HELP, DISTRIBUTION, EXIT_OK, EXIT_USAGE
from runner.cli.environment import ENVIRONMENT, document_environment, environment_epilog


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        click.echo(f"runner {version(DISTRIBUTION)} ({DISTRIBUTION})")
    except PackageNotFoundError:
        click.echo(f"runner: the {DISTRIBUTION} distribution is not installed", err=True)
        ctx.exit(EXIT_USAGE)
    ctx.exit(EXIT_OK)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=environment_epilog(tuple(ENVIRONMENT)),
)
@click.option("--tools", envvar="RUNNER_TOOLS", default=None, help=_TOOLS_HELP)
@click.option(
    "--policies", envvar="RUNNER_POLICIES", default=None, type=click.Path(path_type=Path), help=_POLICIES_HELP
)
@click.option(
    "--audit-log", envvar="RUNNER_AUDIT_LOG", default=None, type=click.Path(path_type=Path), help=_AUDIT_HELP
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the installed version and exit.",
)
@click.pass_context
def cli(ctx: click.Context, tools: str | None, policies: Path | None, audit_log: Path | None) -> None:
    """A sandboxed tool runner for LLM agents."""
    ctx.obj = {"tools": tools, "policies": policies, "audit_log": audit_log}


def _register_commands() -> None:
    # Each command group in its own module; all imported here so that `runner --help`
    # lists them (what a command needs beyond that, it imports when it runs).
    from runner.cli.audit import audit_group
    from runner.cli.call import exec_command
    from runner.cli.client import client_group
    from runner.cli.host import completion_command, doctor_command, images_group, init_command
    from runner.cli.mcp import mcp_group
    from runner.cli.serve import export_command, serve_group
    from runner.cli.tools import list_command, new_command, show_command, validate_command

    for command in (
        init_command,
        new_command,
        list_command,
        show_command,
        exec_command,
        validate_command,
        doctor_command,
        images_group,
        audit_group,
        export_command,
        serve_group,
        client_group,
        mcp_group,
        completion_command,
    ):
        cli.add_command(command)


_register_commands()
document_environment(cli)


def main() -> None:
    try:
        cli.main(standalone_mode=False, complete_var="_RUNNER_COMPLETE")  # also under python -m runner
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"runner: {' '.join(exc.format_message().split())}", err=True)
        sys.exit(EXIT_USAGE)
    except click.exceptions.Abort as exc:
        # click turns Ctrl-C outside a call (while loading, say) into Abort; nothing runs yet.
        sys.exit(130 if isinstance(exc.__context__, KeyboardInterrupt) else EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(130)
