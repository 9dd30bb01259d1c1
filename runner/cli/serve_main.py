"""``runner serve``: load the runner, then serve it until stopped."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import anyio

from runner.api import Runner
from runner.cli._common import EXIT_OK, _fail_usage
from runner.config.locations import find_policy, tool_dirs
from runner.errors import ConfigError
from runner.mcp.serve.app import Caller, ToolService
from runner.mcp.serve.lifecycle import Transport, run_until_stopped
from runner.mcp.serve.local_socket import Where
from runner.mcp.serve.reload import Reloader
from runner.telemetry import RunnerMetrics
from runner.telemetry.connections import ConnectionLimits, listener_share, raise_descriptor_limit
from runner.telemetry.tracing import configure_from_env

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def serve(
    options: dict[str, Any],
    *,
    role: str | None,
    http: str | None,
    metrics: str | None,
    metrics_token_env: str | None = None,
    socket_path: str | None = None,
    stdio: bool = True,
) -> None:
    """Run the server; exit 0 when it stopped (end of input, SIGTERM), 2 on misuse.

    MCP over stdio (``stdio``) or HTTP (``http``), and the socket for ``runner exec`` at
    ``socket_path`` ("": the default one) when it is given.
    """
    from runner.mcp.serve.http import HttpAddressError, parse_address

    metrics_token = _metrics_token(metrics, metrics_token_env)
    # Connections, sandboxes and pools all take descriptors: the soft limit (often 1024)
    # goes up to the hard one, and the listeners' caps are fitted to what is there.
    descriptors = raise_descriptor_limit()

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
    transport: Transport | None = None
    if stdio and http is None:
        resolved = runner.policy.resolve_role(role)
        if resolved is None or resolved not in runner.policy.model.roles:
            runner.close()
            _fail_usage(f"--role {resolved!r} is not a role of {runner.policy.source}")
        caller = Caller(resolved)
        service = ToolService(runner, lambda _ctx: caller, runner.policy.model.serve.max_concurrent)
        from runner.mcp.serve.stdio import StdioTransport

        transport = StdioTransport(service)
    elif http is None:  # the socket alone: no MCP client
        service = ToolService(runner, lambda _ctx: Caller(None), runner.policy.model.serve.max_concurrent)
    listeners = (http is not None) + (metrics_at is not None) + (socket_path is not None)
    limits = _limits(runner, descriptors, listeners=max(1, listeners))
    if http is not None:
        from runner.mcp.serve.http import http_caller

        service = ToolService(runner, http_caller, runner.policy.model.serve.max_concurrent)
        transport = _http_transport(runner, service, http, limits)
    if socket_path is not None:
        where = Where.of(policy_path, dirs, options["audit_log"])
        most = listener_share(descriptors, max(1, listeners))
        transport = _with_socket(runner, service, transport, socket_path, where, most)
    if transport is None:
        runner.close()
        _fail_usage("serve needs --stdio, --http HOST:PORT or --socket [PATH]")
    reloader = Reloader(runner, policy_path, dirs, service.tools_changed)
    _run(runner, service, transport, reloader, _Metrics(metrics_at, metrics_token, limits))


def _http_transport(runner: Runner, service: ToolService, http: str, limits: ConnectionLimits) -> Transport:
    from runner.mcp.serve.http import HttpAddressError, HttpTransport, parse_address

    try:
        host, port = parse_address(http)
    except HttpAddressError as exc:
        runner.close()
        _fail_usage(str(exc))
    try:
        transport = HttpTransport(service, host, port, limits)
    except OSError as exc:
        runner.close()
        _fail_usage(f"cannot listen on {http}: {exc.strerror or exc}")
    if not runner.policy.model.serve.tokens:
        runner.audit.operator.warn("serve: no serve.tokens in the policy; every request is refused (401)")
    # stderr: the address, with the port the system chose for port 0.
    print(f"runner: serving MCP at {transport.url}", file=sys.stderr, flush=True)
    return transport


def _with_socket(
    runner: Runner, service: ToolService, transport: Transport | None, path_text: str, where: Where, most: int
) -> Transport:
    """The socket for ``runner exec`` (``path_text`` "": the default), beside ``transport``,
    holding at most ``most`` connections whatever the policy says (its descriptors' share)."""
    from runner.config.sockets import SocketPlaceError, default_socket
    from runner.mcp.serve.local_socket import Alongside, SocketTransport, bind

    path = Path(path_text) if path_text else default_socket()
    try:
        listener = bind(path.absolute(), shared=bool(runner.policy.model.serve.socket.uids))
    except SocketPlaceError as exc:
        runner.close()
        _fail_usage(f"--socket: {exc}")
    local = SocketTransport(service, listener, where, most)
    if runner.policy.model.serve.socket.max_open > most:
        runner.audit.operator.warn(
            f"serve: serve.socket.max_open lowered to {most} (RLIMIT_NOFILE is too low for more; "
            "raise the hard limit, e.g. systemd's LimitNOFILE)"
        )
    print(f"runner: serving runner exec at {local.path}", file=sys.stderr, flush=True)
    return local if transport is None else Alongside(transport, local)


@dataclass(frozen=True)
class _Metrics:
    """Where ``--metrics`` listens (None: nowhere), its scrape token and connection limits."""

    at: tuple[str, int] | None
    token: str | None
    limits: ConnectionLimits


def _metrics_token(metrics: str | None, env: str | None) -> str | None:
    """The scrape token in the environment variable ``env``; exits 2 on misuse."""
    if env is None:
        return None
    if metrics is None:
        _fail_usage("--metrics-token-env needs --metrics HOST:PORT")
    token = os.environ.get(env, "").strip()
    if not token:
        _fail_usage(f"--metrics-token-env {env}: the variable is not set or empty")
    return token


def _limits(runner: Runner, descriptors: int, *, listeners: int) -> ConnectionLimits:
    """The policy's connection limits, fitted to ``descriptors``; the operator hears of a cut."""
    wanted = ConnectionLimits.from_policy(runner.policy.model.serve.connections)
    fitted = wanted.within(descriptors, listeners)
    if fitted.max_open < wanted.max_open:
        runner.audit.operator.warn(
            f"serve: serve.connections.max_open lowered to {fitted.max_open} per listener "
            f"(RLIMIT_NOFILE is {descriptors}; raise the hard limit, e.g. systemd's LimitNOFILE)"
        )
    return fitted


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
    metrics: _Metrics,
) -> NoReturn:
    """Serve with the metrics listener and the exporters of traces set up around it."""
    from runner.telemetry.listener import MetricsServer

    listener: MetricsServer | None = None
    if metrics.at is not None and runner.metrics is not None:
        host, port = metrics.at
        try:
            listener = MetricsServer(runner.metrics, host, port, metrics.limits, metrics.token)
        except OSError as exc:
            runner.close()
            _fail_usage(f"cannot listen on {host}:{port} for --metrics: {exc.strerror or exc}")
        if host not in LOOPBACK and metrics.token is None:
            runner.audit.operator.warn(
                f"serve: --metrics listens on {host}, beyond this machine, without --metrics-token-env; "
                "anyone who reaches it reads every tool's name and counts"
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
