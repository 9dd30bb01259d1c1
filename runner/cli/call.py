"""``runner exec``: one call from the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from runner.cli._common import EXIT_FAILED, EXIT_OK, _fail_usage, _load, _location_options, _print_json


def _read_input(what: str, path: str | None = None) -> str:
    """The text of ``path``, else of stdin, read no further than a request's bound (from
    ``/dev/zero`` too). The params' own bound is the runner's, on their compact JSON: a
    file may be indented, and ``runner exec``'s fast path reads as far."""
    from runner.config.sockets import MAX_REQUEST_BYTES as limit

    try:
        if path is None:
            if sys.stdin is None:
                _fail_usage(f"cannot read {what}: stdin is closed")
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with Path(path).open("rb") as source:
                data = source.read(limit + 1)
    except OSError as exc:
        _fail_usage(f"cannot read {what}: {exc.strerror or 'read failed'}")
    if len(data) > limit:
        _fail_usage(f"{what}: more than {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail_usage(f"{what}: not UTF-8 text (byte {exc.start})")


def _params(value: str | None) -> object:
    if value is None:
        return {}
    text = value
    if value == "@-":
        text = _read_input("the params on stdin")
    elif value.startswith("@"):
        text = _read_input(f"the params in {value[1:]}", value[1:])
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


@click.command("exec")
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
@click.option(
    "--direct",
    is_flag=True,
    help="Run the call in this process, never through runner serve --socket.",
)
@click.option(
    "--save-content",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Write the content blocks the tool attached (text, images, audio, resources) to files in DIR.",
)
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
    direct: bool,
    save_content: Path | None,
) -> None:
    """Call TOOL, or read one whole request from stdin when TOOL is '-'.

    Prints the answer as JSON (indented on a terminal); exits 0 on success, 1 when the
    call failed, 130 after Ctrl-C (once the tool's sandbox is gone). On a terminal the
    tool's progress and log lines go to stderr as they come. A call the policy's
    approval: holds asks yes/no on the terminal (/dev/tty) first. When runner serve
    --socket serves the same policy and tools, the call goes there (faster; same answer).
    """
    del direct  # read by runner.entry before this command line was loaded
    from sandboxes import plugins

    # The default backend's watchdog (every shipped backend's) boots on the other core while
    # the tools load; the call waits for it.
    plugins.start_early("subprocess")
    request: object
    if tool == "-":
        try:
            request = json.loads(_read_input("the request on stdin"))
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
    from runner.call.approval import CALL_APPROVER
    from runner.cli.content import save_content as write_blocks
    from runner.cli.content import terminal_events
    from runner.cli.interrupt import Interrupted, handle_interruptibly
    from runner.cli.prompt import terminal_approver
    from runner.cli.terminal import Output, readable_json

    runner = _load(ctx)
    CALL_APPROVER.set(terminal_approver())  # a call the policy holds is asked about on the terminal
    name = request.get("toolName") if isinstance(request, dict) else None
    shown = terminal_events(str(name))
    try:
        answer = handle_interruptibly(runner, request, shown)
    except Interrupted as stopped:
        sys.exit(128 + stopped.signum)
    finally:
        if shown is not None:
            shown.close()
    if save_content is not None and answer.get("content"):
        try:
            write_blocks(answer["content"], save_content)
        except OSError as exc:
            _fail_usage(f"cannot write the content to {save_content}: {exc.strerror or 'write failed'}")
    out = Output.detect()
    if out.human:
        out.write(readable_json(answer, out))
    else:
        _print_json(answer)
    sys.exit(EXIT_OK if answer["success"] else EXIT_FAILED)
