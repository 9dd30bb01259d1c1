"""What the command modules share: exit codes, loading the runner, the location options."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.api import Runner

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DISTRIBUTION = "sandboxed-tool-runner"  # the name on the package index; it installs `runner`
_Command = TypeVar("_Command", bound=Callable[..., Any])


def _fail_usage(message: str) -> NoReturn:
    click.echo(f"runner: {message}", err=True)
    sys.exit(EXIT_USAGE)


def _load(ctx: click.Context) -> Runner:
    from runner.api import Runner

    options = ctx.obj
    try:
        return Runner.load(
            tools=options["tools"],
            policies=options["policies"],
            audit_log=options["audit_log"],
            warm_pools=False,  # one-shot commands; `serve` keeps a runner and wants them
        )
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))


def _print_json(document: object) -> None:
    # Strict JSON out: a NaN or Infinity here is a runner bug, never something to print.
    click.echo(json.dumps(document, ensure_ascii=True, allow_nan=False))


_TOOLS_HELP = "Tool directories, joined with ':' (default: tools/ beside the policy file)."
_POLICIES_HELP = (
    "The policy file (default: the first of ./policies.yaml, $XDG_CONFIG_HOME/runner/, /etc/runner/)."
)
_AUDIT_HELP = "Where audit events go (default: the policy's audit.path)."


def _set_location(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value is not None and param.name is not None:
        ctx.obj[param.name] = value  # the group's dict: a flag after the command wins


def _location_options(command: _Command) -> _Command:
    """``--tools``, ``--policies`` and ``--audit-log`` after the command as well."""
    for option in (
        click.option(
            "--audit-log",
            type=click.Path(path_type=Path),
            expose_value=False,
            callback=_set_location,
            help=_AUDIT_HELP,
        ),
        click.option(
            "--policies",
            type=click.Path(path_type=Path),
            expose_value=False,
            callback=_set_location,
            help=_POLICIES_HELP,
        ),
        click.option("--tools", expose_value=False, callback=_set_location, help=_TOOLS_HELP),
    ):
        command = option(command)
    return command
