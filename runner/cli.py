"""The command line (SPEC 6). Exit codes: 0 success, 1 the call failed, 2 misuse.

Nothing a user can cause prints a traceback: configuration problems become one line on
stderr and exit 2; call failures are answers on stdout and exit 1.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from runner.cli_help import ENVIRONMENT, document_environment, environment_epilog
from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.api import Runner
    from runner.policy import Policy

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


def _set_location(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value is not None and param.name is not None:
        ctx.obj[param.name] = value  # the group's dict: a flag after the command wins


def _location_options(command: _Command) -> _Command:
    """``--tools``, ``--policies`` and ``--audit-log`` after the command as well (SPEC 6)."""
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


@cli.command("init")
@click.argument("directory", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite files that are already there.")
def init_command(directory: Path, force: bool) -> None:
    """Write a starter policies.yaml, the example tools and a workspace folder into DIRECTORY."""
    from runner.starter import StarterExists, write_starter

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


@cli.command("new")
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
    from runner.locations import find_policy, tool_dirs
    from runner.scaffold import ScaffoldError, new_tool

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


@cli.command("list")
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
    from runner.terminal import Output, print_tools

    out = Output.detect()
    if out.human:
        print_tools(tools, out)
        return
    from runner.tool_errors import printable  # a description may be a third party's words

    for tool in tools:
        tags = printable(",".join(tool["metadata"]["tags"]))
        line = (
            f"{tool['name']:<20} {tool['metadata']['sandbox']:<10} [{tags}] {printable(tool['description'])}"
        )
        click.echo(line)


@cli.command("show")
@_location_options
@click.argument("tool")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the default when piped).")
@click.pass_context
def show_command(ctx: click.Context, tool: str, as_json: bool) -> None:
    """One tool: description, schemas, resolved limits, what it asks for, which roles may call it.

    Exits 1 when no registered tool has that name.
    """
    from runner.terminal import Output, print_tool_sheet
    from runner.tool_sheet import UnknownTool, tool_sheet

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


def _params(value: str | None) -> object:
    if value is None:
        return {}
    text = value
    if value == "@-":
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError:
            _fail_usage("the params on stdin are not UTF-8 text")
    elif value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            _fail_usage(f"params file {value[1:]} is not UTF-8 text (byte {exc.start})")
        except OSError as exc:
            _fail_usage(f"cannot read params file {value[1:]}: {exc.strerror or 'read failed'}")
    try:
        # NaN and Infinity parse here; the runner then refuses them as INVALID_PARAMS.
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        _fail_usage(f"--params is not valid JSON: {_json_problem(exc)}")


def _json_problem(exc: ValueError | RecursionError) -> str:
    """What is wrong with a JSON text, and where, in words (never an exception's name)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} (line {exc.lineno}, column {exc.colno})"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else " ".join(str(exc).split())


@cli.command("exec")
@_location_options
@click.argument("tool")
@click.option("--params", default=None, help="JSON object, @FILE to read it from a file, or @- from stdin.")
@click.option("--role", default=None, help="Call as this role (default: the policy's default_role).")
@click.option(
    "--timeout",
    type=click.IntRange(min=1),
    default=None,
    metavar="MS",
    help="Milliseconds one attempt may run before it is killed.",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Retries after a failed attempt (not counting the first).",
)
@click.option(
    "--retry-delay",
    type=click.IntRange(min=0),
    default=None,
    metavar="MS",
    help="Milliseconds between attempts.",
)
@click.option(
    "--deadline",
    type=click.IntRange(min=1),
    default=None,
    metavar="MS",
    help="Milliseconds for the whole call, every attempt and delay included.",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["json", "raw"]),
    default=None,
    help="json: the result is the tool's stdout parsed; raw: its text as is.",
)
@click.option(
    "--request-id", default=None, help="The call's id in the answer and the audit log (default: generated)."
)
@click.option("--step-id", default=None, help="The agent's step this call belongs to, for the audit log.")
@click.pass_context
def exec_command(
    ctx: click.Context,
    tool: str,
    params: str | None,
    role: str | None,
    timeout: int | None,
    retries: int | None,
    retry_delay: int | None,
    deadline: int | None,
    output_format: str | None,
    request_id: str | None,
    step_id: str | None,
) -> None:
    """Call TOOL, or read one whole request from stdin when TOOL is '-'.

    Prints the answer as JSON (indented on a terminal); exits 0 on success, 1 when the
    call failed, 130 after Ctrl-C (once the tool's sandbox is gone).
    """
    from sandboxes import plugins

    # The default backend's watchdog (every shipped backend's) boots on the other core while
    # the tools load; the call waits for it.
    plugins.start_early("subprocess")
    request: object
    if tool == "-":
        try:
            request = json.loads(sys.stdin.read())
        except (ValueError, RecursionError) as exc:
            _fail_usage(f"stdin is not a JSON request: {_json_problem(exc)}")
    else:
        options = {
            "timeout": timeout,
            "retries": retries,
            "retryDelay": retry_delay,
            "deadline": deadline,
            "format": output_format,
        }
        request = {
            "toolName": tool,
            "params": _params(params),
            "options": {k: v for k, v in options.items() if v is not None},
        }
        for key, value in (("role", role), ("requestId", request_id), ("stepId", step_id)):
            if value is not None:
                request[key] = value
    from runner.interrupt import Interrupted, handle_interruptibly
    from runner.terminal import Output, readable_json

    runner = _load(ctx)
    try:
        answer = handle_interruptibly(runner, request)
    except Interrupted as stopped:
        sys.exit(128 + stopped.signum)
    out = Output.detect()
    if out.human:
        out.write(readable_json(answer, out))
    else:
        _print_json(answer)
    sys.exit(EXIT_OK if answer["success"] else EXIT_FAILED)


@cli.command("validate")
@_location_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document: tools, problems, counts.")
@click.pass_context
def validate_command(ctx: click.Context, as_json: bool) -> None:
    """Load tools and policies, report every problem, list the registry (exit 1 on an error)."""
    from runner.validation import human_lines, validate, wire

    runner = _load(ctx)
    report = validate(runner.registry, runner.policy)
    if as_json:
        _print_json(wire(report))
    else:
        human_lines(report, click.echo)
    sys.exit(EXIT_FAILED if report.errors else EXIT_OK)


@cli.command("doctor")
@_location_options
@click.option("--json", "as_json", is_flag=True, help="Print the layers as a JSON array.")
@click.pass_context
def doctor_command(ctx: click.Context, as_json: bool) -> None:
    """Which isolation layers work on this machine, and what is missing."""
    from runner.doctor import check_layers
    from runner.terminal import Output, print_layers

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
    from runner.locations import find_policy
    from runner.policy import Policy

    try:
        return Policy.load(find_policy(ctx.obj["policies"]))
    except ConfigError:
        return None


@cli.group("images")
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
    from runner.locations import examples_dir
    from sandboxes import SandboxUnavailable
    from sandboxes.docker.images import ImageBuildError, build_images

    def progress(message: str) -> None:
        click.echo(f"images: {message}", err=True)

    try:
        build_images(contexts or examples_dir() / "tool_images", progress)
    except (SandboxUnavailable, ImageBuildError) as exc:
        _fail_usage(str(exc))


def _register_commands() -> None:
    # Their own modules; imported here so that `runner --help` lists them.
    from runner.audit_commands import audit_group
    from runner.serve.commands import export_command, serve_group

    cli.add_command(audit_group)
    cli.add_command(export_command)
    cli.add_command(serve_group)


def _register_mcp() -> None:
    # runner mcp add: its own module (runner.hosted), like the serve commands.
    from runner.hosted.commands import mcp_group

    cli.add_command(mcp_group)


_register_commands()
_register_mcp()


document_environment(cli)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
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
