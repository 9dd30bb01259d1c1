"""``runner serve``: load the runner, then serve it until stopped."""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

import anyio

from runner.api import Runner
from runner.cli._common import EXIT_OK, _fail_usage
from runner.config.locations import find_policy, tool_dirs
from runner.errors import ConfigError
from runner.mcp.serve.app import Caller, ToolService
from runner.mcp.serve.lifecycle import Transport, run_until_stopped
from runner.mcp.serve.reload import Reloader
from runner.telemetry import MetricsServer, RunnerMetrics
from runner.telemetry.tracing import configure_from_env

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def serve(options: dict[str, Any], *, role: str | None, http: str | None, metrics: str | None) -> None:
    """Run the server; exit 0 when it stopped (end of input, SIGTERM), 2 on misuse."""
    from runner.mcp.serve.http import HttpAddressError, parse_address

    # The MCP SDK reads a request's ``_meta`` trace context itself, and OpenTelemetry logs
    # each ``tracestate`` member it rejects, raw: a client's escape sequences and newlines
    # on the operator's stderr. Our own parsing drops such a header before that logger.
    logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)

    try:
        metrics_at = parse_address(metrics) if metrics is not None else None
    except HttpAddressError:
        _fail_usage(f"--metrics {metrics!r} is not HOST:PORT")
    try:
        policy_path = find_policy(options["policies"])
        dirs = tool_dirs(options["tools"], policy_path)
        runner = Runner.load(
            tools=dirs,
            policies=policy_path,
            audit_log=options["audit_log"],
            metrics=_own_metrics() if metrics_at is not None else None,
        )
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))
    if http is None:
        resolved = runner.policy.resolve_role(role)
        if resolved is None or resolved not in runner.policy.model.roles:
            runner.close()
            _fail_usage(f"--role {resolved!r} is not a role of {runner.policy.source}")
        caller = Caller(resolved)
        service = ToolService(runner, lambda _ctx: caller, runner.policy.model.serve.max_concurrent)
        from runner.mcp.serve.stdio import StdioTransport

        _run(
            runner,
            service,
            StdioTransport(service),
            Reloader(runner, policy_path, dirs, service.tools_changed),
            metrics_at,
        )
    from runner.mcp.serve.http import HttpTransport, http_caller

    try:
        host, port = parse_address(http)
    except HttpAddressError as exc:
        runner.close()
        _fail_usage(str(exc))
    service = ToolService(runner, http_caller, runner.policy.model.serve.max_concurrent)
    try:
        transport = HttpTransport(service, host, port)
    except OSError as exc:
        runner.close()
        _fail_usage(f"cannot listen on {http}: {exc.strerror or exc}")
    if not runner.policy.model.serve.tokens:
        runner.audit.operator.warn("serve: no serve.tokens in the policy; every request is refused (401)")
    # stderr: the address, with the port the system chose for port 0.
    print(f"runner: serving MCP at {transport.url}", file=sys.stderr, flush=True)
    _run(runner, service, transport, Reloader(runner, policy_path, dirs, service.tools_changed), metrics_at)


def _own_metrics() -> RunnerMetrics:
    """The server's metrics: this process is the runner's alone, so prometheus_client's
    global switch for the ``*_created`` series may be turned off (docs/observability.md lists none)."""
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it untyped
    return RunnerMetrics()


def _run(
    runner: Runner,
    service: ToolService,
    transport: Transport,
    reloader: Reloader,
    metrics_at: tuple[str, int] | None,
) -> NoReturn:
    """Serve with the metrics listener and the exporters of traces set up around it."""
    listener: MetricsServer | None = None
    if metrics_at is not None and runner.metrics is not None:
        host, port = metrics_at
        try:
            listener = MetricsServer(runner.metrics, host, port)
        except OSError as exc:
            runner.close()
            _fail_usage(f"cannot listen on {host}:{port} for --metrics: {exc.strerror or exc}")
        if host not in LOOPBACK:
            runner.audit.operator.warn(
                f"serve: --metrics listens on {host}, beyond this machine; /metrics has no authentication"
            )
        print(f"runner: serving metrics at {listener.url}", file=sys.stderr, flush=True)
    stop_tracing = configure_from_env(runner.audit.operator.warn)
    try:
        anyio.run(run_until_stopped, service, reloader, transport)
    finally:
        if stop_tracing is not None:
            stop_tracing()  # the spans still buffered are exported
        if listener is not None:
            listener.close()
    sys.exit(EXIT_OK)
