"""``runner serve``: load the runner, then serve it until stopped."""

from __future__ import annotations

import sys
from typing import Any

import anyio

from runner.api import Runner
from runner.cli import EXIT_OK, _fail_usage
from runner.errors import ConfigError
from runner.locations import find_policy, tool_dirs
from runner.serve.app import Caller, ToolService
from runner.serve.lifecycle import run_until_stopped
from runner.serve.reload import Reloader


def serve(options: dict[str, Any], *, role: str | None, http: str | None) -> None:
    """Run the server; exit 0 when it stopped (end of input, SIGTERM), 2 on misuse."""
    try:
        policy_path = find_policy(options["policies"])
        dirs = tool_dirs(options["tools"], policy_path)
        runner = Runner.load(tools=dirs, policies=policy_path, audit_log=options["audit_log"])
    except ConfigError as exc:
        _fail_usage(" ".join(str(exc).split()))
    if http is None:
        resolved = runner.policy.resolve_role(role)
        if resolved is None or resolved not in runner.policy.model.roles:
            runner.close()
            _fail_usage(f"--role {resolved!r} is not a role of {runner.policy.source}")
        caller = Caller(resolved)
        service = ToolService(runner, lambda _ctx: caller, runner.policy.model.serve.max_concurrent)
        reloader = Reloader(runner, policy_path, dirs, service.tools_changed)
        from runner.serve.stdio import StdioTransport

        anyio.run(run_until_stopped, service, reloader, StdioTransport(service))
        sys.exit(EXIT_OK)
    from runner.serve.http import HttpAddressError, HttpTransport, http_caller, parse_address

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
    reloader = Reloader(runner, policy_path, dirs, service.tools_changed)
    anyio.run(run_until_stopped, service, reloader, transport)
    sys.exit(EXIT_OK)
