"""``runner init``, ``runner doctor`` and ``runner images build``: this host's set-up."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.call.policy import Policy

from runner.cli._common import EXIT_FAILED, EXIT_OK, _fail_usage, _location_options, _print_json


@click.command("init")
@click.argument("directory", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite files that are already there.")
def init_command(directory: Path, force: bool) -> None:
    """Write a starter policies.yaml, the example tools and a workspace folder into DIRECTORY."""
    from runner.config.starter import StarterExists, write_starter

    try:
        directory.mkdir(parents=True, exist_ok=True)
        starter = write_starter(directory, force=force)
    except StarterExists as exc:
        shown = ", ".join(str(path) for path in exc.existing[:3])
        more = f" and {len(exc.existing) - 3} more" if len(exc.existing) > 3 else ""
        _fail_usage(f"{directory}: {shown}{more} already there; pass --force to overwrite")
    except OSError as exc:
        _fail_usage(f"cannot write into {directory}: {exc.strerror or exc}")
    click.echo(
        f"wrote policies.yaml, {len(starter.tools)} example tools in tools/ and a workspace/ folder"
        f" into {directory}"
    )
    where = "" if directory == Path() else f"cd {directory} && "
    click.echo(f'try: {where}runner exec add_numbers --params \'{{"a": 1, "b": 2}}\'')


@click.command("doctor")
@_location_options
@click.option("--json", "as_json", is_flag=True, help="Print the layers as a JSON array.")
@click.pass_context
def doctor_command(ctx: click.Context, as_json: bool) -> None:
    """Which isolation layers work on this machine, and what is missing."""
    from runner.cli.doctor import check_layers
    from runner.cli.terminal import Output, print_layers

    layers = check_layers(_policy_if_any(ctx))
    out = Output.detect()
    if as_json:
        _print_json([layer.__dict__ for layer in layers])
    elif out.human:
        print_layers(layers, out)
    else:
        for layer in layers:
            mark = "ok     " if layer.ok else "MISSING"
            hint = "" if layer.ok else f"  -> {layer.hint}"
            click.echo(f"{mark} {layer.backend + ': ' + layer.name:<34} {layer.detail}{hint}")
    sys.exit(EXIT_OK if all(layer.ok for layer in layers) else EXIT_FAILED)


def _policy_if_any(ctx: click.Context) -> Policy | None:
    """The policy the other commands would use, when there is one (its backend settings)."""
    from runner.call.policy import Policy
    from runner.config.locations import find_policy

    try:
        return Policy.load(find_policy(ctx.obj["policies"]))
    except ConfigError:
        return None


@click.group("images")
def images_group() -> None:
    """Docker images for docker-sandboxed tools."""


@images_group.command("build")
@click.option(
    "--contexts",
    default=None,
    type=click.Path(path_type=Path),
    help="Folder of build contexts, each a Dockerfile FROM runner/base:latest (default: the shipped ones).",
)
def images_build_command(contexts: Path | None) -> None:
    """Build runner/base:latest from Debian packages, then every tool image."""
    from runner.config.locations import examples_dir
    from sandboxes import SandboxUnavailable
    from sandboxes.docker.images import ImageBuildError, build_images

    def progress(message: str) -> None:
        click.echo(f"images: {message}", err=True)

    try:
        build_images(contexts or examples_dir() / "tool_images", progress)
    except (SandboxUnavailable, ImageBuildError) as exc:
        _fail_usage(str(exc))


@click.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion_command(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for SHELL (click's own).

    bash: eval "$(runner completion bash)" in ~/.bashrc; zsh: the same with zsh in
    ~/.zshrc; fish: runner completion fish > ~/.config/fish/completions/runner.fish
    """
    from click.shell_completion import get_completion_class

    completion = get_completion_class(shell)
    assert completion is not None  # the choice admits only shells click knows
    root = ctx.find_root()
    click.echo(completion(root.command, {}, "runner", "_RUNNER_COMPLETE").source())
