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
