"""The ``runner audit`` commands (registered by ``runner.cli``): search and follow the trail,
``verify`` its hash chain (against a ``head`` recorded earlier too), ``report`` what the
calls did.

Each reads the log at ``--log``, else where the runner writes (``--audit-log``,
``RUNNER_AUDIT_LOG``, the policy's ``audit.path``). Exit codes as everywhere: 0, 1 (verify:
the chain is broken), 2 (misuse: no log, an unreadable one, a bad option).
"""

from __future__ import annotations

import collections
import io
import itertools
import os
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import click

from runner.cli._common import EXIT_FAILED, EXIT_OK, _Command, _fail_usage, _location_options, _print_json
from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.audit.key import ChainKey
    from runner.audit.query import AuditFilter
    from runner.audit.report import AuditReport, GroupBy

_LOG_HELP = "The log to read (default: where the runner writes)."


def _log_option(command: _Command) -> _Command:
    option = click.option("--log", "log_path", default=None, type=click.Path(path_type=Path), help=_LOG_HELP)
    return option(command)


@click.group("audit", invoke_without_command=True)
@_location_options
@click.option("--request-id", default=None, help="A request id, or the start of one.")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="Print at most this many events, the oldest first.",
)
@click.option(
    "--last",
    type=click.IntRange(min=1),
    default=None,
    help="Print only the newest N matching events (newest last; with --follow, like tail -n N -f).",
)
@click.option("--tool", default=None, help="Only events of this tool.")
@click.option("--role", default=None, help="Only events of calls made as this role.")
@click.option(
    "--decision",
    type=click.Choice(["allow", "deny"]),
    default=None,
    help="Only policy decisions that allowed, or denied.",
)
@click.option("--code", default=None, help="Error code, e.g. TIMEOUT.")
@click.option("--since", default=None, help="Only events at or after this ISO 8601 time.")
@click.option("--until", default=None, help="Only events at or before this ISO 8601 time.")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep printing matching events as they are appended, until Ctrl-C (like tail -f).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines, one event a line.")
@_log_option
@click.pass_context
def audit_group(
    ctx: click.Context,
    request_id: str | None,
    limit: int | None,
    last: int | None,
    tool: str | None,
    role: str | None,
    decision: str | None,
    code: str | None,
    since: str | None,
    until: str | None,
    follow: bool,
    as_json: bool,
    log_path: Path | None,
) -> None:
    """Search the audit trail (a table, coloured on a terminal; --json for JSON lines);
    verify its hash chain; report per tool, role or client."""
    if ctx.invoked_subcommand is not None:
        return
    from runner.audit.follow import follow as follow_log
    from runner.audit.follow import pipe_reader_gone
    from runner.audit.query import AuditFilter, query, write_table
    from runner.cli.terminal import Output, audit_row, audit_table

    path = _log(ctx, log_path)
    wanted = AuditFilter(
        request_id=request_id,
        tool=tool,
        role=role,
        decision=decision,
        code=code,
        since=_time_option(since, "--since"),
        until=_time_option(until, "--until"),
    )
    out = Output.detect()
    if follow and isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # a followed event is wanted now, not when a buffer fills
    try:
        found = follow_log(path, wanted, pipe_reader_gone(sys.stdout)) if follow else query(path, wanted)
        if last is not None:
            found = _newest(found, last, path, wanted, follow)
        events = itertools.islice(found, limit)
        if as_json:
            for event in events:
                _print_json(event)
        elif out.human:
            table = audit_table(out)
            table.header()
            for event in events:
                table.row(audit_row(event))
        else:
            write_table(events, sys.stdout)
    except KeyboardInterrupt:
        if not follow:  # Ctrl-C is how --follow ends, not an error; elsewhere it cuts a search short
            sys.exit(130)
    except BrokenPipeError:
        _reader_gone()
    except OSError as exc:
        _unreadable(path, exc)


def _anchor(_: click.Context, __: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    if len(value) != 64 or not all(char in "0123456789abcdefABCDEF" for char in value):
        raise click.BadParameter("a head is 64 hex digits, as runner audit head prints it")
    return value.lower()


@audit_group.command("verify")
@_location_options
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as one JSON object.")
@click.option(
    "--allow-unchained-prefix",
    is_flag=True,
    help="Accept (and count) unchained lines before the first chained one: "
    "a log written before audit.chain was turned on.",
)
@click.option(
    "--head",
    "anchor",
    metavar="HASH",
    default=None,
    callback=_anchor,
    help="A head recorded earlier (runner audit head): fail unless that line is still there, intact.",
)
@click.option("--key-env", metavar="NAME", default=None, help="Read the chain's key from this variable.")
@click.option(
    "--key-file",
    type=click.Path(path_type=Path),
    default=None,
    help="Read the chain's key from this file (default for both: the policy's audit.key).",
)
@_log_option
@click.pass_context
def verify_command(
    ctx: click.Context,
    as_json: bool,
    allow_unchained_prefix: bool,
    anchor: str | None,
    key_env: str | None,
    key_file: Path | None,
    log_path: Path | None,
) -> None:
    """Check the hash chain of the whole log: exit 0 when intact, 1 when a line was changed,
    removed, inserted or unchained, the tail was cut, or the --head line is not there. A
    keyed chain (audit.key) is checked with its key, read as the runner reads it."""
    from runner.audit.verify import verify
    from runner.cli.terminal import Output

    path = _log(ctx, log_path)
    key = _chain_key(ctx, key_env, key_file)
    try:
        verdict = verify(path, allow_unchained_prefix, key.secret if key else None, anchor)
    except OSError as exc:
        _unreadable(path, exc)
    except KeyboardInterrupt:
        sys.exit(130)
    if as_json:
        _print_json(verdict.as_json())
    else:
        from runner.cli.audit_output import print_verdict

        print_verdict(verdict, path, key, Output.detect())
    sys.exit(EXIT_OK if verdict.intact else EXIT_FAILED)


@audit_group.command("head")
@_location_options
@click.option("--json", "as_json", is_flag=True, help='Print {"head": HASH, "lines": N}.')
@_log_option
@click.pass_context
def head_command(ctx: click.Context, as_json: bool, log_path: Path | None) -> None:
    """Print the last line's hash and the line count, to keep elsewhere: runner audit verify
    --head HASH later fails if that line is gone or changed. Checks no hash (verify does);
    exit 1 when the last line carries none."""
    from runner.audit.verify import read_head

    path = _log(ctx, log_path)
    try:
        head = read_head(path)
    except OSError as exc:
        _unreadable(path, exc)
    if as_json:
        _print_json(head.as_json())
    elif head.hash is not None:
        click.echo(f"{head.hash} {head.lines}")
    if head.hash is None:
        why = "it is empty" if not head.lines else "its last line carries no hash (torn, or unchained)"
        click.echo(f"runner: audit log {path} has no head: {why}; runner audit verify says more", err=True)
        sys.exit(EXIT_FAILED)
    sys.exit(EXIT_OK)


@audit_group.command("report")
@_location_options
@click.option("--since", default=None, help="Only events at or after this ISO 8601 time.")
@click.option(
    "--by",
    "by",
    type=click.Choice(["tool", "role", "client", "session"]),
    default="tool",
    help="Group the calls by tool (default), role, client (the HTTP token's name) or session.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option(
    "--html",
    "html_path",
    default=None,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the report as one self-contained web page with charts (per tool; nothing is fetched).",
)
@_log_option
@click.pass_context
def report_command(
    ctx: click.Context,
    since: str | None,
    by: str,
    as_json: bool,
    html_path: Path | None,
    log_path: Path | None,
) -> None:
    """Per group: calls, successes, denials by reason, errors by code and reason, p50/p95 duration."""
    if html_path is not None and by != "tool":
        _fail_usage("--html reports per tool: leave out --by")
    from runner.audit.report import report_file
    from runner.cli.terminal import Output

    path = _log(ctx, log_path)
    try:
        report = report_file(path, cast("GroupBy", by), _time_option(since, "--since"))
    except OSError as exc:
        _unreadable(path, exc)
    except KeyboardInterrupt:
        sys.exit(130)
    if html_path is not None:
        _write_html(report, path, html_path)
    try:
        if as_json:
            _print_json(report.as_json())
        else:
            from runner.cli.audit_output import print_report

            print_report(report, Output.detect())
    except BrokenPipeError:
        _reader_gone()
    sys.exit(EXIT_OK)


def _write_html(report: AuditReport, log: Path, target: Path) -> NoReturn:
    """The page, written beside ``target`` and renamed into place (never half a page)."""
    import tempfile

    from runner.audit.html import render

    page = render(report, str(log))
    try:
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".html")
    except OSError as exc:
        _fail_usage(f"cannot write {target}: {exc.strerror or exc}")
    temporary = Path(name)
    try:
        # errors: a log of an older runner may hold a lone surrogate (a request's tool name).
        with os.fdopen(handle, "w", encoding="utf-8", errors="replace") as out:
            out.write(page)
        temporary.chmod(0o644)
        temporary.replace(target)
    except OSError as exc:
        _fail_usage(f"cannot write {target}: {exc.strerror or exc}")
    finally:
        temporary.unlink(missing_ok=True)
    click.echo(f"wrote {target}")
    sys.exit(EXIT_OK)


# -- what the commands share ----------------------------------------------------------------


def _log(ctx: click.Context, log_path: Path | None) -> Path:
    path = log_path or ctx.obj["audit_log"] or _policy_audit_path(ctx)
    if path is None:
        _fail_usage("no audit log file is configured (events go to stderr); pass --log")
    if not path.is_file():
        _fail_usage(f"audit log {path} does not exist")
    return cast(Path, path)


def _newest(
    found: Iterator[dict[str, Any]], last: int, path: Path, wanted: AuditFilter, follow: bool
) -> Iterator[dict[str, Any]]:
    """The newest ``last`` events of ``found`` in log order; when following, the newest
    ``last`` of the backlog and then every new one."""
    if not follow:
        return iter(collections.deque(found, maxlen=last))
    from runner.audit.query import query

    backlog = sum(1 for _ in query(path, wanted))
    return itertools.islice(found, max(0, backlog - last), None)


def _time_option(value: str | None, flag: str) -> datetime | None:
    from runner.audit.query import parse_time

    if value is None:
        return None
    when = parse_time(value)
    if when is None:
        _fail_usage(f"{flag} is not an ISO 8601 time: {value}")
    return when


def _policy_audit_path(ctx: click.Context) -> Path | None:
    from runner.call.policy import Policy
    from runner.config.locations import find_policy

    try:
        return Policy.load(find_policy(ctx.obj["policies"])).audit_path
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))


def _chain_key(ctx: click.Context, key_env: str | None, key_file: Path | None) -> ChainKey | None:
    """The key ``verify`` checks with: ``--key-env`` or ``--key-file``, else the policy's
    ``audit.key`` when a policy is given or found; None (unkeyed) only when neither sets one."""
    from pydantic import ValidationError

    from runner.audit.key import ChainKeyError, ChainKeySource, policy_chain_key, read_chain_key
    from runner.call.policy import Policy
    from runner.config.locations import find_policy

    if key_env is not None and key_file is not None:
        _fail_usage("give --key-env or --key-file, not both")
    if key_env is not None or key_file is not None:
        flag = "--key-env" if key_env is not None else "--key-file"
        try:
            source = ChainKeySource(env=key_env, file=None if key_file is None else str(key_file))
            return read_chain_key(source, Path.cwd())
        except ValidationError as exc:
            _fail_usage(f"{flag}: {exc.errors()[0]['msg']}")
        except ChainKeyError as exc:
            _fail_usage(f"{flag}: {exc}")
    try:
        policy_path = find_policy(ctx.obj["policies"])
    except ConfigError:
        return None  # none given, none found: nothing says the chain is keyed
    try:
        policy = Policy.load(policy_path)
        return policy_chain_key(policy.model.audit.key, policy.base_dir, policy.source)
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))


def _unreadable(path: Path, exc: OSError) -> NoReturn:
    _fail_usage(f"cannot read audit log {path}: {exc.strerror or 'read failed'}")


def _reader_gone() -> None:
    # The reader went away (`runner audit | head`): not an error. Point stdout at
    # /dev/null so that the interpreter's last flush does not complain either.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
